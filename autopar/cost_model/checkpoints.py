"""Full recompute's saved block input split over tp and kept in host memory, as DeepSpeed's
activation checkpointing and Megatron-LM's ``--distribute-saved-activations`` keep it.

Units: bytes and seconds, one block and one micro-batch on one rank. Under full recompute a
block keeps only its input, whole on every tp rank without sequence parallelism
(``memory.activation_bytes``: the full mode's entry). Then:

- partitioned (``Framework.checkpoint_partitioned``): each tp rank keeps 1/tp of it and,
  before the block's re-run, all-gathers it over tp and waits (sourced: DeepSpeed
  deepspeed/runtime/activation_checkpointing/checkpointing.py ``partition_activations`` and
  ``gather_partitioned_activations``, an ``all_gather_into_tensor`` on the model-parallel
  group; Megatron-LM megatron/core/tensor_parallel/random.py ``CheckpointFunction``:
  ``split_tensor_into_1d_equal_chunks`` forward, ``gather_split_1d_tensor`` backward). The
  gathered input lives while the block re-runs (its working set).
- offloaded (``Framework.checkpoint_offloaded``, DeepSpeed ``cpu_checkpointing``): the rank's
  part goes to host memory after the block's forward (``partition.cpu()``, a blocking copy)
  and comes back before the gather (``.to(device)``), each copy at the host link's bandwidth
  (``Cluster.pcie_bytes_per_s``, offload.py ``pcie_link``) and waited for; the device keeps
  none of it. Host memory: the part of every micro-batch in flight on the first pipeline
  rank, the most (``pipeline.in_flight_microbatches``).
"""

from __future__ import annotations

import dataclasses

from autopar.config import ParallelConfig
from autopar.cost_model import comm
from autopar.cost_model.pipeline import in_flight_microbatches

__all__ = ["CheckpointTerms", "checkpoint_terms"]

Modes = tuple[float, float, float]  # one value per recompute mode (none, selective, full)


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointTerms:
    """What partitioned or offloaded checkpoints change in one block's full-recompute mode.

    Attributes:
        kept_bytes: the input's bytes the device keeps per micro-batch (the full entry).
        gathered_bytes: the input's bytes gathered back while the block re-runs (transient).
        gather_s: the exposed tp all-gather before the re-run.
        copy_s: the exposed host copies, down after the forward and up before the re-run.
        host_bytes: host memory of the rank's parts in flight.
    """

    kept_bytes: float
    gathered_bytes: float = 0.0
    gather_s: float = 0.0
    copy_s: float = 0.0
    host_bytes: float = 0.0

    def activations(self, act: Modes) -> Modes:
        """Saved bytes by recompute mode with the full mode's input as kept."""
        return (act[0], act[1], self.kept_bytes)

    def transient(self, values: Modes) -> Modes:
        """The working set by recompute mode with the gathered input in the full mode's."""
        return _full(values, self.gathered_bytes)

    def rerun(self, values: Modes) -> Modes:
        """Per-mode seconds (the re-run's) with the host copies in the full mode's."""
        return _full(values, self.copy_s)

    def tp_comm(self, values: Modes) -> Modes:
        """Per-mode exposed tp seconds with the gather in the full mode's."""
        return _full(values, self.gather_s)


def _full(values: Modes, extra: float) -> Modes:
    """``values`` (none, selective, full) with ``extra`` added to the full mode's entry."""
    return (values[0], values[1], values[2] + extra)


def checkpoint_terms(fw, cfg: ParallelConfig, is_block: bool, input_bytes: float,
                     tp_link: comm.GroupLink, pcie_link: comm.GroupLink) -> CheckpointTerms:
    """The terms of one layer whose full-recompute entry keeps ``input_bytes`` per micro-batch
    (module docstring); nothing changes unless the layer is a block and ``fw`` partitions."""
    if not (is_block and fw.checkpoint_partitioned) or input_bytes <= 0:
        return CheckpointTerms(kept_bytes=input_bytes)
    part = input_bytes / cfg.tp
    gather_s = comm.all_gather_s(tp_link, input_bytes) if cfg.tp > 1 else 0.0
    if not fw.checkpoint_offloaded:
        return CheckpointTerms(kept_bytes=part, gathered_bytes=input_bytes - part,
                               gather_s=gather_s)
    return CheckpointTerms(
        kept_bytes=0.0, gathered_bytes=input_bytes, gather_s=gather_s,
        copy_s=2 * comm.host_copy_s(pcie_link, part),
        host_bytes=part * in_flight_microbatches(cfg.schedule, cfg.pp, cfg.virtual_stages,
                                                 cfg.num_microbatches, 0))
