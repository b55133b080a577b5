"""A block's mixture of experts as the cost model sees it (``MoEStructure``), read from its
modules: the grouped experts graph/moe.py recognises, the router's top-k, the shared experts'
width, the capacity factor and the router imbalance the model states, and which module holds
the router and the experts.
"""

from __future__ import annotations

from torch import nn

from autopar.graph.moe import expert_modules, expert_weights, modules_ep_blocker, routed_top_k
from autopar.graph.types import MoEStructure
from autopar.models.spec import MAX_ROUTER_IMBALANCE, router_imbalance_valid

__all__ = ["block_moe", "model_router_imbalance", "moe_modules"]


def _stated(value: object, where: str) -> float:
    """A stated router imbalance as a float (0: none stated).

    Raises:
        ValueError: a value that is not a number in [1, MAX_ROUTER_IMBALANCE] (nor 0).
    """
    if value is None:
        return 0.0
    if not router_imbalance_valid(value):
        raise ValueError(f"{where} states router_imbalance {value!r}: give a number between 1 "
                         f"and {MAX_ROUTER_IMBALANCE:g} (or 0: unknown)")
    return float(value)  # type: ignore[arg-type]  # router_imbalance_valid: a number


def _router_imbalance(block: nn.Module) -> float:
    """The block's ``router_imbalance`` attribute (models/moe.py MoE; a model of one's own may
    set it on any of its block's modules): the busiest expert-parallel rank's routed rows over
    the average under dropless routing; 0 where no module states it."""
    for name, module in block.named_modules():
        value = _stated(getattr(module, "router_imbalance", None),
                        f"module {name or '<block>'!r}")
        if value:
            return value
    return 0.0


def model_router_imbalance(model: nn.Module) -> float:
    """The router imbalance a whole model states for its blocks: its own ``router_imbalance``
    attribute, else its config's (a Hugging Face config.json may carry a ``router_imbalance``
    key, which transformers keeps on the config); 0 where it states none. A block's own
    statement (``block_moe``) wins over it."""
    own = _stated(getattr(model, "router_imbalance", None), "the model")
    if own:
        return own
    return _stated(getattr(getattr(model, "config", None), "router_imbalance", None),
                   "the model's config")


def _shared_width(block: nn.Module) -> int:
    """Inner width of the block's shared experts (a dense MLP named shared_expert(s))."""
    width = 0
    for name, module in block.named_modules():
        if name.rpartition(".")[2] not in ("shared_expert", "shared_experts"):
            continue
        for leaf in ("w2", "down_proj"):
            down = getattr(module, leaf, None)
            if isinstance(down, nn.Linear):
                width += down.in_features
    return width


def block_moe(block: nn.Module, model_imbalance: float = 0.0) -> MoEStructure | None:
    """The MoEStructure of a block (its first experts module), or None for a dense block;
    ``model_imbalance`` (``model_router_imbalance``) where the block states no router
    imbalance of its own."""
    found = expert_modules(block)
    if not found:
        return None
    weights = expert_weights(found[0][1])
    assert weights is not None  # expert_modules keeps recognised modules only
    return MoEStructure(
        experts=weights.experts,
        top_k=routed_top_k(block),
        shared_experts=round(_shared_width(block) / weights.inner) if weights.inner else 0,
        hidden=weights.hidden,
        expert_hidden=weights.inner,
        expert_params=weights.params,
        capacity_factor=float(getattr(found[0][1], "capacity_factor", 0.0) or 0.0),
        router_imbalance=_router_imbalance(block) or model_imbalance,
        ep_blocker=modules_ep_blocker([m for _n, m in found]),
        module=_moe_module(block, found[0][0]),
    )


def moe_modules(root: nn.Module) -> list[str]:
    """FQNs (relative to ``root``) of the modules that hold a router and grouped experts
    (``MoEStructure.module``'s modules), sorted."""
    return sorted({held for name, _m in expert_modules(root)
                   if (held := _moe_module(root, name))})


def _moe_module(block: nn.Module, experts_path: str) -> str:
    """The path of the experts' parent when it also holds the router (a child that is neither
    the experts nor shared experts), else "" (``MoEStructure.module``)."""
    parent, _, name = experts_path.rpartition(".")
    if not parent:
        return ""
    others = [child for child, _m in block.get_submodule(parent).named_children()
              if child not in (name, "shared_expert", "shared_experts", "shared_expert_gate")]
    return parent if others else ""
