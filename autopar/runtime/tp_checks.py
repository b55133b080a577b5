"""Checks that tensor parallelism can split a model as a plan says, before any process starts.

Split from apply.py (``check_plan_runnable`` calls ``check_tensor_parallel`` when tp > 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from autopar.cost_model.framework_support import fsdp_recuts_tp_shards, recut_fix
from autopar.cost_model.validate import tp_problem
from autopar.errors import AutoparError
from autopar.graph.tp import is_norm, split_blocker
from autopar.runtime.tensor_parallel import build_tp_plan, default_tp_layout, resolve_layout
from autopar.tp_layout import TPStyle

if TYPE_CHECKING:
    from autopar.plan import Plan
    from autopar.runtime.pipeline_parallel import ModelStructure

__all__ = ["check_tensor_parallel"]


def check_tensor_parallel(model: nn.Module, plan: Plan, structure: ModelStructure) -> None:
    """Raise an AutoparError if tp > 1 cannot split ``model`` as ``plan`` says.

    Checks the layout against the modules (a style each can take), the head counts against tp,
    norms with weights inside the split region, parameters of a split module's own (attention
    sinks), sequence parallelism's norms, a fused q/k/v
    attention that must run on one rank's shapes (and FSDP over it), and that the layout splits
    something in the blocks. Every message names the part and the split that works.
    """
    cfg = plan.config
    layout = plan.tp_layout or default_tp_layout(model, structure.container)
    sp = cfg.sequence_parallel
    build_tp_plan(model, layout, container=structure.container, sp=sp,
                  first_block=structure.first_block)
    resolved = resolve_layout(model, layout)
    _check_tp_heads(model, resolved, cfg.tp, structure.container)
    _check_split_modules(model, resolved, cfg.tp)
    if sp:
        for fqn, module in model.named_modules():
            sequence = resolved.get(fqn) == TPStyle.SEQUENCE
            if is_norm(module) and not sequence and not _inside(fqn, resolved):
                raise AutoparError(
                    f"sequence parallelism needs every norm in the tp_layout as 'sequence'; "
                    f"{fqn} is not: fix the plan's tp_layout or turn sequence_parallel off"
                )
    fused = sorted(fqn for fqn, style in resolved.items() if style == TPStyle.COLWISE_QKV)
    if fused:
        _check_fused_attention(model, resolved, fused[0], cfg.tp)
    if fused and fsdp_recuts_tp_shards(cfg):
        raise AutoparError(
            f"FSDP (zero {cfg.zero}) cannot shard {fused[0]} under tp={cfg.tp}: its tensor-"
            "parallel split keeps each rank's q, k and v heads together (a strided shard that "
            f"FSDP2 cannot cut again over dp); {recut_fix(cfg)}, or pp with tp"
        )
    if not any(fqn.startswith(structure.container + ".") for fqn in resolved):
        raise AutoparError(
            f"{type(model).__name__} cannot be split with tp={cfg.tp}: no linear in its blocks "
            f"at {structure.container!r} has a tensor-parallel style (the graph knows q/k/v/o, "
            f"MLP and fused q/k/v projections by name); use --dp {cfg.world_size} or "
            f"--pp {cfg.world_size}"
        )


def _check_fused_attention(model: nn.Module, resolved: dict[str, str], fqn: str, tp: int) -> None:
    # The attention must run on one rank's share of its fused q/k/v (widths / tp, heads / tp).
    from autopar.graph.fused_attention import local_attention_error

    parent = fqn.rsplit(".", 1)[0]
    styles = {f.removeprefix(parent + "."): st for f, st in resolved.items()
              if f.startswith(parent + ".")}
    error = local_attention_error(model.get_submodule(parent), styles, tp)
    if error is not None:
        raise AutoparError(
            f"{type(model).__name__} cannot be split with tp={tp}: its attention {parent} does not "
            f"run on one rank's share of the fused q/k/v {fqn} ({error}); tensor parallelism "
            "needs the attention to size its views by its width and head attributes (split_size "
            "or n_embd, n_head or num_heads) or by -1, not by its input's width; use --pp or --dp"
        )


def _colwise_parent_fqns(resolved: dict[str, str]) -> set[str]:
    column = (TPStyle.COLWISE, TPStyle.COLWISE_QKV)
    return {f.rsplit(".", 1)[0] for f, st in resolved.items() if st in column}


def _inside(fqn: str, resolved: dict[str, str]) -> bool:
    # Whether module ``fqn`` sits inside a split region (under a parent of colwise linears).
    return any(fqn.startswith(parent + ".") for parent in _colwise_parent_fqns(resolved))


def _check_split_modules(model: nn.Module, resolved: dict[str, str], tp: int) -> None:
    # The modules whose linears the layout splits must hold nothing per head beside them
    # (graph.tp.split_blocker: a norm with weights inside, a parameter of their own).
    # (a top-level vocabulary-parallel head is its own "parent": no module around it)
    blocker = split_blocker(model, _colwise_parent_fqns(resolved) - set(resolved))
    if blocker:
        raise AutoparError(f"{type(model).__name__} cannot be split with tp={tp}: {blocker}; "
                           "use --pp or --dp (with --zero 3)")


def _check_tp_heads(
    model: nn.Module, resolved: dict[str, str], tp: int, container: str
) -> None:
    # The heads tp shards: the HF config's, or a fused-qkv attention module's own head count.
    config = getattr(model, "config", None)
    counts = {
        name: getattr(config, name, None)
        for name in ("num_attention_heads", "num_key_value_heads", "n_head")
    }
    for fqn, style in resolved.items():
        if style == TPStyle.COLWISE_QKV:
            parent = fqn.rsplit(".", 1)[0]
            for name in ("n_head", "num_heads"):
                counts[f"{parent}.{name}"] = getattr(model.get_submodule(parent), name, None)
    problem = tp_problem(tp, [(f"{name} of the blocks at {container!r}", value)
                              for name, value in counts.items()
                              if isinstance(value, int) and not isinstance(value, bool)])
    if problem:
        raise AutoparError(f"{problem} (tensor parallelism shards attention heads)")
