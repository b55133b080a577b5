"""A lm head tied to the token embedding (GPT-2, nanoGPT, the zoo's GPT presets) under pp and tp.

The one-process step has one weight W used twice, its gradient the sum of the embedding's and the
head's. Split, it stays one step:

* pp > 1 (Megatron-LM's scheme): the first stage holds W as the embedding and the last stage a
  copy as its head (``untie`` before the split: the head gets its own parameter, equal to W).
  After the step's backward, and after data parallelism has reduced both, ``sync_tied_grads``
  sums the two gradients: an all-reduce over the pair of pipeline ranks that hold them (the pp
  ranks of the first and the last stage, one pair per (dp, cp, tp) coordinate, ``pair_group``),
  or in place where one rank holds both (ZBV and DualPipeV put the last stage on pp rank 0). Both
  copies then take the same optimizer step from the same value and stay equal.
* pp == 1, tp > 1: the vocab-parallel embedding and head shard W alike (vocabulary rows,
  ``Shard(0)`` over tp), so after tensor parallelism the head is pointed back at the embedding's
  DTensor (``retie``): one weight, as in one process.

The cost model charges the same: the last stage holds the head's copy of W, its gradient and
optimizer state (``cost_model/memory``, ``ModelProfile.tied_embeddings``), and one all-reduce of
its gradient per step (``cost_model/dp_comm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import AutoparError
from autopar.tp_layout import TPStyle

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TiedCopies", "check_tied_split", "pair_group", "prepare_tied", "retie",
           "sync_tied_grads", "tied_copies", "tied_fqns", "untie"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TiedCopies:
    """Where the copies of a tied weight live after a pipeline split.

    Attributes:
        fqns: the weight's two FQNs in the full model, in registration order (the first is the
            name the one-process model gives it: its optimizer state's name in checkpoints).
        group: the pair of pp ranks holding the two copies (this rank is in it), or None when
            this rank holds both or neither.
    """

    fqns: tuple[str, str]
    group: Any


def tied_fqns(model: nn.Module) -> tuple[str, str] | None:
    """The first two FQNs that name one parameter (a tied lm head and embedding), or None."""
    seen: dict[int, str] = {}
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            if id(param) in seen:
                return seen[id(param)], fqn
            seen[id(param)] = fqn
    return None


def check_tied_split(model: nn.Module, fqns: tuple[str, str], before: tuple[str, ...],
                     after: tuple[str, ...], layout: dict[str, str] | None, tp: int,
                     world_size: int) -> None:
    """Raise unless the split can keep the tie: the weight is shared by a module before the block
    container (the token embedding) and one after it (the lm head), and with tp > 1 the layout
    shards both over the vocabulary (embedding ``rowwise``, head ``colwise``: ``retie``).

    Args:
        model: the full model; fqns: ``tied_fqns(model)``; before / after: the structure's
            outer modules (``ModelStructure.before`` / ``after``); layout: the plan's
            tp_layout (None: the default); tp: the plan's tp; world_size: for the message.
    """
    from autopar.runtime.tensor_parallel import default_tp_layout, resolve_layout

    def under(fqn: str, names: tuple[str, ...]) -> bool:
        return any(name and (fqn == name or fqn.startswith(name + ".")) for name in names)

    # Either may be registered first (nanoGPT assigns the head's weight to the embedding).
    ends = fqns if under(fqns[0], before) else (fqns[1], fqns[0])
    owners = [fqn.rpartition(".")[0] for fqn in ends]
    if not (under(ends[0], before) and under(ends[1], after)):
        raise AutoparError(
            f"{type(model).__name__} ties {fqns[1]} to {fqns[0]} (one weight); autopar splits a "
            "weight shared only between the token embedding and the lm head; untie them or use "
            f"--dp {world_size}")
    if tp > 1:
        styles = resolve_layout(model, layout or default_tp_layout(model))
        if (styles.get(owners[0]), styles.get(owners[1])) != (TPStyle.ROWWISE, TPStyle.COLWISE):
            raise AutoparError(
                f"{fqns[1]} is tied to {fqns[0]} but tensor parallelism does not shard both over "
                "the vocabulary (a token embedding and an lm head whose sizes match the "
                f"vocabulary); untie them or use tp=1")


def _owner(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    module_fqn, _, name = fqn.rpartition(".")
    return model.get_submodule(module_fqn), name


def untie(model: nn.Module, fqns: tuple[str, str]) -> None:
    """Give the second user of the tied weight (the head) its own parameter, equal to it."""
    module, name = _owner(model, fqns[1])
    shared = getattr(module, name)
    setattr(module, name, nn.Parameter(shared.detach().clone(),
                                       requires_grad=shared.requires_grad))


def retie(part: nn.Module, fqns: tuple[str, str]) -> None:
    """Point the head back at the embedding's (tensor-parallel) weight.

    Raises:
        AutoparError: tensor parallelism sharded the two differently (a layout that does not
            shard both over the vocabulary).
    """
    first, first_name = _owner(part, fqns[0])
    second, second_name = _owner(part, fqns[1])
    weight, other = getattr(first, first_name), getattr(second, second_name)
    placements = [getattr(p, "placements", None) for p in (weight, other)]
    if placements[0] != placements[1] or weight.shape != other.shape:
        raise AutoparError(
            f"{fqns[1]} is tied to {fqns[0]} but the tp_layout shards them differently "
            f"({placements[0]} vs {placements[1]}); give both the vocab-parallel style "
            "(the default layout) or untie them")
    setattr(second, second_name, weight)


def prepare_tied(model: nn.Module, pp: int, tp: int) -> tuple[str, str] | None:
    """The FQNs of a weight tied between the embedding and the head when the plan splits the
    model (pp > 1 or tp > 1), else None; under pp > 1 the head is given its own copy first."""
    fqns = tied_fqns(model) if pp > 1 or tp > 1 else None
    if fqns and pp > 1:
        untie(model, fqns)
    return fqns


def tied_copies(fqns: tuple[str, str] | None, mesh: DeviceMesh, schedule: str, pp: int,
                num_stages: int) -> TiedCopies | None:
    """Where a pipeline split's two copies live (None without a tie or a pipeline): the pp
    ranks of the first and the last stage under ``schedule`` (collective: every rank calls it)."""
    if not fqns or pp == 1:
        return None
    from autopar.schedules import rank_of_stage

    ends = [rank_of_stage(schedule, pp, s) for s in (0, num_stages - 1)]
    return TiedCopies(fqns=fqns, group=pair_group(mesh, ends[0], ends[1]))


def pair_group(mesh: DeviceMesh, first_rank: int, last_rank: int) -> Any:
    """The process group of this rank's pair of pp ranks ``first_rank`` (the first stage's) and
    ``last_rank`` (the last stage's), or None: when they are one rank, or this rank is neither.

    Every rank takes part in creating every pair's group (``new_subgroups_by_enumeration``),
    one pair per (dp, cp, tp) coordinate.
    """
    if first_rank == last_rank:
        return None
    names = list(mesh.mesh_dim_names or ())
    ranks = mesh.mesh.movedim(names.index("pp"), -1)
    pairs = ranks.reshape(-1, ranks.shape[-1])[:, [first_rank, last_rank]].tolist()
    mine, _all = dist.new_subgroups_by_enumeration(pairs)
    return mine


def _local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """``param``'s gradient as a local tensor laid out like the parameter: a DTensor gradient
    in other placements (the vocab-parallel embedding's backward gives a replicated one) is
    redistributed to the parameter's first, so both copies hold the same rows."""
    grad = param.grad
    if grad is None:
        return None
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return grad
    if isinstance(param, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(placements=param.placements)
        param.grad = grad
    return grad.to_local()


def sync_tied_grads(parts: tuple[nn.Module, ...], copies: TiedCopies,
                    device: torch.device) -> None:
    """Sum the tied weight's gradients over its copies (module docstring), in place."""
    held = {}
    for part in parts:
        for fqn, param in part.named_parameters():
            if fqn in copies.fqns:
                held[fqn] = param
    grads = [g for g in (_local_grad(p) for p in held.values()) if g is not None]
    if len(held) == 2:  # both copies on this rank
        if len(grads) == 2:
            total = grads[0] + grads[1]
            grads[0].copy_(total)
            grads[1].copy_(total)
        return
    if copies.group is None or not grads:
        return
    grad = grads[0]
    # Offloaded gradients live in host memory; the collective runs on the device.
    moved = grad.to(device) if grad.device != device else grad
    dist.all_reduce(moved, group=copies.group)
    if moved is not grad:
        grad.copy_(moved)
