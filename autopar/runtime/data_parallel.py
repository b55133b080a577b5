"""Data parallelism by ZeRO stage, with torch's own wrappers (a no-op when dp == 1).

What each ``config.zero`` means in torch terms (the cost model charges exactly this):

* 0, pp == 1 and tp == 1: ``DistributedDataParallel(process_group=mesh["dp"].get_group())``:
  replicated parameters, gradients and optimizer state; gradients all-reduced (bucketed) in the
  last micro-batch's backward (``no_sync`` before it).
* 0, pp > 1 or tp > 1: ``replicate()`` (``torch.distributed._composable.replicate_with_fsdp``,
  FSDP2's replicated mode) per block and on the stage root: same memory as DDP; each unit's
  gradients are all-reduced after the last micro-batch's backward. DDP is never combined with
  pipelining (it gives wrong gradients after its first bucket rebuild) nor with tensor
  parallelism (in torch 2.13 it hides DTensor parameters from ``named_parameters`` and its losses
  drift from the third step).
* 1 and 2: FSDP2 ``fully_shard(reshard_after_forward=False)`` per block and on the stage root:
  parameters, gradients and optimizer state are stored sharded over dp; parameters are
  all-gathered at the first forward of the step and stay unsharded until the step's last backward
  (``set_reshard_after_backward(False)`` on the other micro-batches). Zero 1 keeps unsharded
  gradients across micro-batches and reduce-scatters once per step
  (``set_requires_gradient_sync(False)`` before the last micro-batch); zero 2 reduce-scatters every
  micro-batch into sharded gradient accumulators.
* 3: FSDP2 ``fully_shard`` (``reshard_after_forward=True``) per block and on the root: each block's
  parameters are all-gathered for forward, freed, all-gathered again for backward; gradients are
  reduce-scattered every micro-batch. (FSDP2 never reshards the root module after forward.)

HSDP (``dp_replicate > 1``, zero >= 1): the same FSDP2 units on the 2-D (replicate, shard) mesh
(``mesh.data_parallel_mesh``): parameters sharded over the shard axis, gradients reduce-scattered
over it and then all-reduced over the replicate axis. With context parallelism every mechanism runs
over dp x cp flattened ("dp_cp"): the cp ranks of a replica hold the same parameters.

Offload (zero >= 1): FSDP2 ``CPUOffloadPolicy`` on every unit, for ``offload="params"`` and
``offload="optimizer"`` alike (torch has no optimizer-only offload for FSDP2): the sharded
parameters and gradients live in host memory, each unit's parameters are copied to the device for
its all-gather, its reduced gradient shard is copied back to the host, and the optimizer step runs
on the host over the host shards. ``optimizer`` thus also keeps parameters and gradients on the
host between uses (more than the name says); the cost model charges the configured offload.

Mixed precision: bf16/fp16 under FSDP2 use ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``
(fp32 sharded master weights); other paths run the forward under ``torch.autocast``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopar.config import dp_mechanism
from autopar.models.zoo import TORCH_DTYPES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.config import ParallelConfig

__all__ = ["apply_data_parallel", "dp_mechanism", "mp_policy"]



def mp_policy(cfg: ParallelConfig) -> Any:
    """FSDP2's MixedPrecisionPolicy for the config's dtype (see the module docstring)."""
    return _mp_policy(cfg)


def _mp_policy(cfg: ParallelConfig) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if cfg.dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[cfg.dtype], reduce_dtype=torch.float32)


def _offload_policy(cfg: ParallelConfig, device_type: str) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if cfg.offload == "none":
        return OffloadPolicy()
    # Pinned host memory only makes sense next to a GPU (pinning needs CUDA).
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def apply_data_parallel(
    part: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, cfg: ParallelConfig,
    ignored_params: set | None = None,
) -> nn.Module:
    """Wrap one stage module for data parallelism over the data-parallel mesh.

    Args:
        part: the model (pp == 1) or one pipeline stage module, already tensor-parallel.
        blocks: the blocks inside ``part`` (each becomes its own FSDP2 unit).
        dp_mesh: ``mesh.data_parallel_mesh``: the 1-D "dp" (or "dp_cp") axis, or the 2-D
            (replicate, shard) mesh of HSDP.
        cfg: the plan's config (dp, cp, pp, zero, dtype, dp_replicate, offload).
        ignored_params: parameters left out (expert-parallel experts, which differ per rank and
            synchronise their own gradients: runtime/expert_parallel.py).

    Returns:
        The module to run and optimize: ``part`` itself (FSDP2 / replicate act in place) or a
        ``DistributedDataParallel`` wrapper.
    """
    kind = dp_mechanism(cfg)
    if kind == "none":
        return part
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if any(p.is_meta for p in part.parameters()):
            # ``run --dry-run`` builds on the meta device, where DDP cannot be constructed (it
            # reads parameter shapes back and broadcasts values). DDP replicates every parameter,
            # so the unwrapped part holds exactly the bytes a rank would.
            return part
        if ignored_params:
            names = [n for n, p in part.named_parameters() if p in ignored_params]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(part, names)
        # NOTE: the dp axis's process group, not ``device_mesh=dp_mesh``: DDP given a mesh sliced
        # from a larger one assumes tensor parallelism and hooks every forward to swap DTensor
        # parameters in and out (``_pre_dp_module_transform``), pure overhead with tp == 1.
        return DistributedDataParallel(part, process_group=dp_mesh.get_group())
    ignored = set(ignored_params) if ignored_params else None
    if kind == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in blocks:
            replicate(block, mesh=dp_mesh, mp_policy=_mp_policy(cfg), ignored_params=ignored)
        return replicate(part, mesh=dp_mesh, mp_policy=_mp_policy(cfg), ignored_params=ignored)
    from torch.distributed.fsdp import fully_shard

    options = {
        "mesh": dp_mesh,
        "reshard_after_forward": cfg.zero == 3,
        "mp_policy": _mp_policy(cfg),
        "offload_policy": _offload_policy(cfg, dp_mesh.device_type),
        "ignored_params": ignored,
    }
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(part, **options)
    return part
