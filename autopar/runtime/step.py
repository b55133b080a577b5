"""One training step of a ParallelizedModel, equal to the one-process step on the global batch.

Loss: the mean token cross entropy of the whole global batch. Every data-parallel rank gets
``global_batch / dp`` sequences (``local_batch``), split into ``n_mb = global_batch / (dp *
micro_batch)`` micro-batches of equal size, so the global mean is the mean of the micro-batch means
and its gradient is ``1 / (dp * n_mb)`` times the sum of the micro-batch gradients: each
micro-batch loss is scaled by ``1 / n_mb`` (the pipeline schedule does the same with
``scale_grads=True``) and DDP / FSDP2 average gradients over dp. With context parallelism each
rank holds ``s / cp`` tokens of every sequence, its loss is their mean, and the data-parallel
mechanism averages gradients over dp x cp: the global mean's gradient again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.loss import loss_parallel_context

if TYPE_CHECKING:
    from autopar.runtime.apply import ParallelizedModel

__all__ = [
    "call_model", "gathered_grads", "local_batch", "one_process_reference", "split_batch",
    "train_step",
]


def local_batch(pmodel: ParallelizedModel, global_tensor: Any) -> Any:
    """This rank's share of a global batch: the dp-rank's contiguous ``global_batch / dp`` rows,
    and with context parallelism (cp > 1) the cp rank's load-balanced share of each sequence
    (``context_parallel.shard_sequence``: chunks i and 2cp-1-i of 2cp, along dimension 1).

    Every tp and pp rank of one data-parallel replica gets the same rows. ``global_tensor`` may
    also be a model file's batch (a tuple, list or dict of tensors): every tensor whose first
    dimension is the batch's is cut the same way (and, under cp, every such tensor of 2 or more
    dimensions along dimension 1).
    """
    from torch.utils._pytree import tree_map

    from autopar.runtime.context_parallel import shard_sequence
    from autopar.runtime.mesh import dp_rank

    mesh = pmodel.mesh
    rank, size = dp_rank(mesh)
    if isinstance(global_tensor, torch.Tensor):
        rows = global_tensor.chunk(size)[rank]
    else:
        rows = split_batch(global_tensor, size)[rank]
    cp = pmodel.plan.config.cp
    if cp == 1:
        return rows
    cp_rank = mesh.get_local_rank(mesh.mesh_dim_names.index("cp"))
    return tree_map(
        lambda t: shard_sequence(t, cp_rank, cp)
        if isinstance(t, torch.Tensor) and t.dim() >= 2 else t,
        rows,
    )


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` (a tensor, or a tuple / list / dict of them) cut into ``parts`` equal row blocks.

    Tensors whose first dimension is the batch's (that of the first tensor with one) are cut
    along it; anything else is given whole to every part.
    """
    from torch.utils._pytree import tree_flatten, tree_map

    if isinstance(batch, torch.Tensor):
        return list(batch.chunk(parts))
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    rows = leaves[0].shape[0] if leaves else None

    def part(i: int) -> Any:
        def cut(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows:
                return t.chunk(parts)[i]
            return t

        return tree_map(cut, batch)

    return [part(i) for i in range(parts)]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(inputs)`` for a tensor, ``model(*inputs)`` for a tuple or list, ``model(**inputs)``
    for a dict: how a model file's ``example_inputs`` batch is fed (as the profiler does)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


@contextlib.contextmanager
def _grad_sync(model: nn.Module, zero: int, last: bool) -> Iterator[None]:
    # Gradient synchronisation for micro-batch accumulation (see data_parallel.py).
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and not last:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule) and zero == 0:  # replicate(): one all-reduce per step
        model.set_requires_gradient_sync(last)
    if isinstance(model, FSDPModule) and zero in (1, 2):
        model.set_reshard_after_backward(last)
        model.set_requires_gradient_sync(last or zero == 2)
    yield


def _autocast(pmodel: ParallelizedModel) -> contextlib.AbstractContextManager[Any]:
    if pmodel.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(pmodel.mesh.device_type, dtype=pmodel.autocast_dtype)


def _accumulate(pmodel: ParallelizedModel, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    model = pmodel.model_parts[0]
    n_mb = pmodel.plan.config.num_microbatches
    # The losses stay where they were computed until the step's end: reading one back per
    # micro-batch would make the host wait for the GPU and stop it queueing the next one.
    losses: list[torch.Tensor] = []
    for i, (x, y) in enumerate(zip(split_batch(tokens, n_mb), split_batch(labels, n_mb))):
        with _grad_sync(model, pmodel.plan.config.zero, last=i == n_mb - 1):
            with _autocast(pmodel):
                output = call_model(model, x)
            loss = pmodel.loss_fn(output, y)
            (loss / n_mb).backward()
        losses.append(loss.detach().double())
    return float(torch.stack(losses).sum()) / n_mb


def _pipeline(pmodel: ParallelizedModel, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    losses: list[torch.Tensor] = []
    args = (tokens,) if pmodel.has_first_stage else ()
    # return_outputs=False: the last stage keeps no logits of finished micro-batches (the losses
    # are all the step needs), so a step's memory is what the cost model charges.
    kwargs: dict[str, Any] = {"return_outputs": False}
    if pmodel.has_last_stage:
        kwargs.update(target=labels, losses=losses)
    with _autocast(pmodel):
        pmodel.schedule.step(*args, **kwargs)
    if not losses:
        return 0.0
    return float(torch.stack([x.detach().double() for x in losses]).mean())


def _global_mean(pmodel: ParallelizedModel, local_loss: float) -> float:
    # Every (dp, cp, tp) coordinate has exactly one pp rank with the last stage, so the world sum
    # of (loss on last-stage ranks, 0 elsewhere) is tp * sum_{dp,cp}(loss); every cp rank's loss
    # is the mean over an equal share of the tokens, so divide by dp * cp * tp.
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local_loss
    cfg = pmodel.plan.config
    value = torch.tensor([local_loss if pmodel.has_last_stage else 0.0], dtype=torch.float64)
    if pmodel.mesh.device_type == "cuda":
        value = value.cuda()
    dist.all_reduce(value)
    return float(value.item()) / (cfg.data_ranks * cfg.tp)


def train_step(
    pmodel: ParallelizedModel,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer | None,
) -> float:
    """One optimizer step on this rank's share of a global batch.

    Args:
        pmodel: ``apply_plan``'s result.
        tokens: ``LongTensor[global_batch / dp, s]``: this rank's share (``local_batch``); ranks
            without the first pipeline stage may pass anything (it is not read). With pp == 1
            also a model file's batch (tuple / list / dict of tensors, see ``call_model``).
        labels: the matching targets (read only on ranks with the last stage), given to
            ``pmodel.loss_fn(output, labels)``: a model file's loss gets the batch itself.
        optimizer: the optimizer over ``pmodel.parameters()``; None to only compute gradients
            (they are zeroed first either way).

    Returns:
        The mean token loss of the whole global batch, the same on every rank.
    """
    for part in pmodel.model_parts:
        part.zero_grad(set_to_none=True)
    with loss_parallel_context(pmodel.loss_parallel):
        if pmodel.schedule is None:
            local = _accumulate(pmodel, tokens, labels)
        else:
            local = _pipeline(pmodel, tokens, labels)
    if pmodel.tied is not None:  # a tied embedding and head split over pp: sum their gradients
        from autopar.runtime.mesh import mesh_device
        from autopar.runtime.tied_weights import sync_tied_grads

        sync_tied_grads(pmodel.model_parts, pmodel.tied, mesh_device(pmodel.mesh))
    if optimizer is not None:
        optimizer.step()
    return _global_mean(pmodel, local)


def one_process_reference(
    model: nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """The one-process step every split must reproduce: forward and backward on the whole batch.

    Args:
        model: the full model (a separate copy from the one given to ``apply_plan``).
        tokens: ``LongTensor[global_batch, s]``.
        labels: the targets.
        optimizer: stepped after backward if given.
        loss_fn: the loss (default the zoo's token cross entropy).

    Returns:
        The loss; the gradients are left in ``model``'s parameters.
    """
    if loss_fn is None:
        from autopar.models.transformer import cross_entropy_loss

        loss_fn = cross_entropy_loss
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(tokens), labels)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return float(loss.detach())


def _plain_fqn(fqn: str) -> str:
    # DDP prefixes "module."; FSDP2 and replicate() keep FQNs.
    return fqn.removeprefix("module.")


def gathered_grads(pmodel: ParallelizedModel) -> dict[str, torch.Tensor]:
    """Full (unsharded) gradients of this rank's parameters, by full-model FQN.

    DTensor gradients are gathered with ``full_tensor()``: a collective over their mesh, so every
    rank of a pipeline stage must call this together. For tests and debugging.
    """
    from torch.distributed.tensor import DTensor

    grads: dict[str, torch.Tensor] = {}
    for part in pmodel.model_parts:
        for fqn, param in part.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            grads[_plain_fqn(fqn)] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return grads
