"""Expert parallelism: the routed experts of mixture-of-experts layers sharded over ep ranks.

Layout (torchtitan's "dp -> ep"): the dp x cp ranks of the ("pp", "dp", "cp", "tp") mesh are
viewed as (dp cp / ep, ep) (``ep_groups``); the ep consecutive ranks of an ``ep`` group each hold
E / ep of every layer's experts (rank j of the group: experts j E/ep .. (j+1) E/ep - 1, sliced
from the full model built from the same seed everywhere), and the dp cp / ep ranks of an ``edp``
group hold the same experts.

The experts modules are those the runtime can run one expert at a time (``graph.moe``: the
zoo's ``models/moe.py::Experts``, the stacked experts of Hugging Face families and DBRX's
``[E f_e, h]`` matrices, ``ep_blocker`` "", which ``check_plan_runnable`` checks first); each
per-expert tensor is sliced along dim 0 (``graph.moe.expert_params``: one row an expert, or
DBRX's ``f_e``).

Forward of an experts module on ``x[T, h]`` routed to ``top_k``:
the T k (token, expert) assignments are sorted by expert, hence by the rank that holds it; their
counts are exchanged (``all_to_all_single``); the token rows go to their experts' ranks
(``all_to_all_single_autograd``: the dispatch; its backward sends the gradients back), each
rank runs its local experts on what it received (sorted by local expert once, each expert on
its contiguous slice), and the results come back the same way (the combine), are weighted by
the router and summed per token, exactly as the one-process module. Experts called on rows
already routed to every expert (Llama 4, ``graph.moe.routed_rows``) exchange only the rows their
router picked, the others zero rows whose result is zero; without ep they run those rows only
too (``run_picked_rows``), where the family's own code runs every expert on every token.

Gradients: the routed experts are left out of the dense layers' data-parallel wrappers
(``ignored_params``; they differ per ep rank). A rank's expert gradient already sums the
contributions of its ep group's tokens (the dispatch's backward); it is then summed over the
``edp`` group and divided by dp cp, the data-parallel mean the wrappers take of the dense
parameters (over dp x cp with context parallelism, whose ranks hold other tokens of the same
sequences): zero 0 (or ep == dp cp) by a hook on each expert parameter (all-reduce), zero >= 1
by FSDP2 over the edp ranks (``fully_shard`` of the experts module, gradient divide factor
dp cp), which also shards their state over those ranks as ZeRO does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from autopar.graph.moe import (
    ep_blocker,
    expert_modules,
    expert_params,
    local_experts,
    routed_rows,
    run_sorted,
)

if TYPE_CHECKING:
    from autopar.config import ParallelConfig

__all__ = ["EpGroups", "apply_expert_parallel", "ep_groups", "expert_state_views",
           "experts_modules", "run_picked_rows"]


def experts_modules(part: nn.Module) -> list[nn.Module]:
    """The grouped-experts modules inside ``part`` (``graph.moe.expert_modules``)."""
    return [m for _name, m in expert_modules(part)]


@dataclass(frozen=True, slots=True)
class EpGroups:
    """This rank's expert-parallel process groups, its index in its ep group, the edp group as
    a 1-D DeviceMesh (for FSDP2), and both as the 2-D ("ep", "edp") mesh the experts' rows
    are laid out on (for checkpoints: ``expert_state_views``)."""

    ep: Any
    edp: Any
    ep_rank: int
    edp_mesh: Any
    expert_mesh: Any


def ep_groups(cfg: ParallelConfig, device_type: str) -> EpGroups:
    """New process groups for every ep and edp group (every rank creates all, in one order).

    Rank r = (pp_i dp cp + f) tp + tp_i (``build_mesh``'s ("pp", "dp", "cp", "tp") order, f =
    dp_i cp + cp_i the rank's place among the dp x cp ranks that share parameters), f = b ep +
    j: the ep group of (pp_i, tp_i, b) holds j = 0 .. ep - 1, the edp group of (pp_i, tp_i, j)
    holds b = 0 .. dp cp / ep - 1 (torchtitan borrows ep from dp_shard x cp the same way).
    Always new groups, never the default one: the data-parallel wrappers' own collectives run
    on the dp group meanwhile, and sharing a group with them would interleave the two streams
    differently on different ranks.
    """
    rank = dist.get_rank()
    data = cfg.data_ranks
    blocks = data // cfg.ep
    mine: dict[str, Any] = {}
    ep_rank = 0
    for p in range(cfg.pp):
        for t in range(cfg.tp):
            def at(b: int, j: int, p: int = p, t: int = t) -> int:
                return (p * data + b * cfg.ep + j) * cfg.tp + t

            for b in range(blocks):
                ranks = [at(b, j) for j in range(cfg.ep)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine["ep"], ep_rank = group, ranks.index(rank)
                    mine["layout"] = [[at(bb, j) for bb in range(blocks)] for j in range(cfg.ep)]
            for j in range(cfg.ep):
                ranks = [at(b, j) for b in range(blocks)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine["edp"] = group
    from torch.distributed.device_mesh import DeviceMesh

    edp_mesh = DeviceMesh.from_group(mine["edp"], device_type, mesh_dim_names=("edp",))
    expert_mesh = DeviceMesh.from_group([mine["ep"], mine["edp"]], device_type,
                                        mesh=torch.tensor(mine["layout"], dtype=torch.int),
                                        mesh_dim_names=("ep", "edp"))
    return EpGroups(ep=mine["ep"], edp=mine["edp"], ep_rank=ep_rank, edp_mesh=edp_mesh,
                    expert_mesh=expert_mesh)


def _exchange_counts(counts: torch.Tensor, group: Any) -> list[int]:
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received.tolist()


def _exchange(module: nn.Module, group: Any, ep: int, local: int, rows: torch.Tensor,
              expert: torch.Tensor) -> torch.Tensor:
    """Run ``rows[R, h]`` (sorted by ``expert``, their global expert ids) on their experts'
    ranks (``local`` experts each) and bring the results back, in the same order (module
    docstring)."""
    send_splits = torch.bincount(expert // local, minlength=ep)
    in_splits = send_splits.tolist()
    out_splits = _exchange_counts(send_splits, group)
    expert = (expert % local).contiguous()
    recv_expert = torch.empty(sum(out_splits), dtype=expert.dtype, device=expert.device)
    dist.all_to_all_single(recv_expert, expert, out_splits, in_splits, group=group)
    recv = funcol.wait_tensor(funcol.all_to_all_single_autograd(
        rows, out_splits, in_splits, group))
    # The received rows sorted by local expert once; each expert runs on its slice.
    by_expert = torch.argsort(recv_expert, stable=True)
    counts = torch.bincount(recv_expert, minlength=local).tolist()
    out = run_sorted(module, recv.index_select(0, by_expert), counts)
    # NOTE: ``recv * 0``, not zeros: the result must depend on ``recv`` even on a rank whose
    # experts received no rows, or autograd would skip both all-to-alls' backward there
    # while the other ranks of the group wait in theirs. Likewise it depends on the experts'
    # parameters (a zero times each), so their gradient hooks (zero 0: an all-reduce over
    # the edp ranks) run on every rank, rows or not.
    y = recv * 0
    if out.shape[0]:
        y = y.index_add(0, by_expert, out)
    else:
        y = y + sum(p.reshape(-1)[:1].sum() for p in module.parameters()) * 0
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(y, in_splits, out_splits, group))


def _ep_forward(module: nn.Module, group: Any, ep: int):
    """The forward of experts called with the router's choices, ``(x, top_k_index,
    top_k_weights)``: each token's k rows exchanged, weighted and summed per token."""
    local = local_experts(module)

    def forward(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])  # [T, h] (DBRX passes [b, s, h])
        top_k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // top_k
        back = _exchange(module, group, ep, local, x.index_select(0, token), flat[order])
        weights = top_k_weights.reshape(-1).index_select(0, order)
        # Summed per token into a tensor of the input's own shape (not a view of one: FSDP2's
        # output hooks and the caller's in-place adds need a tensor of its own).
        out = x.new_zeros(shape)
        out.view(-1, shape[-1]).index_add_(0, token, (back * weights[:, None]).to(x.dtype))
        return out

    return forward


def _routed_forward(module: nn.Module, experts: int,
                    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """The forward of experts called on rows already routed to every expert, ``x[E T, h]``
    (Llama 4: expert e's block holds every token scaled by its router weight, 0 where the
    router did not pick e): only the nonzero rows run (``run(rows, expert_ids)``, sorted by
    expert), each result in its row's place. A zero row's result is zero (``graph.moe.
    ep_blocker`` checks it), so the rows skipped give what running them gives."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        blocks = x.view(experts, -1, x.shape[-1])
        expert, token = (blocks != 0).any(dim=-1).nonzero(as_tuple=True)  # expert-major
        out = x.new_zeros(x.shape)
        out.index_add_(0, expert * blocks.shape[1] + token,
                       run(blocks[expert, token], expert).to(x.dtype))
        return out

    return forward


def run_picked_rows(part: nn.Module) -> None:
    """Without ep: experts called on routed rows (``graph.moe.routed_rows``, Llama 4, whose
    own forward runs every expert on every token) run only the rows their router picked, the
    k experts a token runs, as the cost model charges (same result: module docstring)."""
    for module in experts_modules(part):
        if routed_rows(module) and not ep_blocker(module):
            experts = local_experts(module)

            def run(rows: torch.Tensor, expert: torch.Tensor, module: nn.Module = module,
                    experts: int = experts) -> torch.Tensor:
                return run_sorted(module, rows, torch.bincount(expert, minlength=experts).tolist())

            module.forward = _routed_forward(module, experts, run)


def _grad_hook(edp_group: Any, edp: int, dp: int):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        if edp > 1:
            dist.all_reduce(grad, group=edp_group)
        return grad / dp

    return hook


def apply_expert_parallel(part: nn.Module, groups: EpGroups | None, cfg: ParallelConfig) -> set:
    """Shard ``part``'s routed experts over the ep group (in place); no-op when ep == 1.

    Args:
        part: the model or one pipeline stage module (full weights, same on every rank).
        groups: ``ep_groups(cfg)`` (None when ep == 1).
        cfg: the plan's config (dp, ep).

    Returns:
        The expert parameters now local to this rank (for the dp wrappers to ignore).
    """
    if cfg.ep <= 1 or groups is None:
        run_picked_rows(part)
        return set()
    modules = experts_modules(part)
    # ZeRO over the edp ranks when there are several (with one, nothing to shard).
    data = cfg.data_ranks  # the ranks whose gradients the data-parallel mean averages
    sharded = cfg.zero >= 1 and data > cfg.ep
    for module in modules:
        # Every parameter of the module is per expert (graph.moe.ep_blocker): weights, biases,
        # each holding its experts along dim 0, ``rows`` rows an expert (expert_params).
        owner, names, rows = expert_params(module)
        local = local_experts(module) // cfg.ep
        lo, hi = groups.ep_rank * local * rows, (groups.ep_rank + 1) * local * rows
        for name in names:
            full = getattr(owner, name)
            param = nn.Parameter(full.detach()[lo:hi].clone(), requires_grad=full.requires_grad)
            if not sharded:
                param.register_hook(_grad_hook(groups.edp, data // cfg.ep, data))
            setattr(owner, name, param)
        if routed_rows(module):
            def run(rows: torch.Tensor, expert: torch.Tensor, module: nn.Module = module,
                    local: int = local) -> torch.Tensor:
                return _exchange(module, groups.ep, cfg.ep, local, rows, expert)

            module.forward = _routed_forward(module, local * cfg.ep, run)
        else:
            module.forward = _ep_forward(module, groups.ep, cfg.ep)
        owner.autopar_expert_mesh = groups.expert_mesh  # read by expert_state_views
        if sharded:
            _shard_experts(module, groups, cfg)
    return {p for module in modules for p in module.parameters()}


def _shard_experts(module: nn.Module, groups: EpGroups, cfg: ParallelConfig) -> None:
    """ZeRO >= 1: FSDP2 over the edp ranks (the dp / ep ranks holding these experts), summing
    their gradients and dividing by dp (the dense parameters' data-parallel mean)."""
    from torch.distributed.fsdp import fully_shard

    from autopar.runtime.data_parallel import mp_policy

    fully_shard(module, mesh=groups.edp_mesh, reshard_after_forward=cfg.zero == 3,
                mp_policy=mp_policy(cfg))
    module.set_gradient_divide_factor(float(cfg.data_ranks))
    # A sum then a division (not NCCL's PREMUL_SUM, which gloo lacks): the same result.
    module.set_force_sum_reduction_for_comms(True)


def expert_state_views(part: nn.Module, model_sd: dict[str, Any],
                       optim_sd: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``part``'s state dicts (``get_state_dict``'s keys; optimizer keys
    prefixed "optim.", model keys "model.") that hold expert-parallel experts, as DTensors of
    the whole ``[E, ...]`` tensor on the ("ep", "edp") mesh, so a checkpoint holds every
    expert once and loads under any split (``runtime/checkpoint.py``).

    Rank (j, b) of the mesh holds experts j E/ep .. (j+1) E/ep - 1: whole on every edp rank
    (zero 0: ``[Shard(0), Replicate()]``), or their FSDP2 shard over edp (``[Shard(0),
    Shard(0)]``: the ep block, then FSDP2's chunk of it). The views share the tensors'
    storage, so ``dcp.load`` into them loads the experts in place.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    owners = {}
    for module in part.modules():
        mesh = getattr(module, "autopar_expert_mesh", None)
        if mesh is not None:
            for param in module.parameters(recurse=False):
                owners[_local(param).data_ptr()] = mesh
    views: dict[str, Any] = {}
    for key, value in model_sd.items():
        mesh = owners.get(_local(value).data_ptr()) if isinstance(value, torch.Tensor) else None
        if mesh is None:
            continue
        for name, tensor in ((f"model.{key}", value), *(
                (f"optim.{k}", v) for k, v in optim_sd.items()
                if k.startswith(f"state.{key}.") and isinstance(v, torch.Tensor) and v.dim())):
            sharded = isinstance(tensor, DTensor)
            local = _local(tensor)
            shape = (tensor.shape[0] * mesh.size(0), *tensor.shape[1:])
            views[name] = DTensor.from_local(
                local, mesh, [Shard(0), Shard(0) if sharded else Replicate()], run_check=False,
                shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
    return views


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
