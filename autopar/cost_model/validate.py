"""Checks of a ParallelConfig against a model profile and a cluster (what the config alone can't).

Each failed check raises ``ValueError`` whose message names the constraint and what to do. The
micro-batch rules per schedule follow torch 2.13's ``torch.distributed.pipelining.schedules``:

- ``ScheduleGPipe``: any number of micro-batches.
- ``Schedule1F1B``: ``n_microbatches >= num_stages`` (one stage per rank, so >= pp).
- ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``: with
  ``rounds = max(1, m // pp)``, ``m % rounds == 0``.
- ``ScheduleZBVZeroBubble``: exactly 2 stages per rank (pads the micro-batch count itself).
- ``ScheduleDualPipeV``: exactly 2 stages per rank and ``m >= num_stages`` (= 2 pp).
"""

from __future__ import annotations

from autopar.config import ParallelConfig
from autopar.cost_model.hardware import Cluster
from autopar.graph.types import ModelProfile

__all__ = ["check_config", "check_dimensions", "check_ep", "check_schedule"]


def check_schedule(schedule: str, pp: int, virtual_stages: int, num_microbatches: int) -> None:
    """Raise ValueError unless torch's schedule class accepts this pipeline shape.

    Args:
        schedule: schedule name.
        pp: pipeline ranks.
        virtual_stages: model chunks per rank.
        num_microbatches: micro-batches per pipeline per step (m).
    """
    if pp <= 1:
        return
    m, stages = num_microbatches, pp * virtual_stages
    if schedule == "1f1b" and m < stages:
        raise ValueError(
            f"schedule 1f1b needs micro-batches per pipeline >= pp ({m} < {pp}); raise "
            "global_batch or lower dp * micro_batch"
        )
    if schedule in ("interleaved-1f1b", "interleaved-zero-bubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(
                f"schedule {schedule} needs micro-batches per pipeline ({m}) to be a multiple of "
                f"the number of rounds max(1, m // pp) = {rounds}; use a multiple of pp = {pp}"
            )
    if schedule in ("zbv-zero-bubble", "dualpipe-v") and virtual_stages != 2:
        raise ValueError(
            f"schedule {schedule} needs exactly 2 stages per rank (virtual_stages=2), "
            f"got {virtual_stages}"
        )
    if schedule == "dualpipe-v" and m < stages:
        raise ValueError(
            f"schedule dualpipe-v needs micro-batches per pipeline >= stages ({m} < {stages})"
        )


def check_dimensions(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig) -> None:
    """Raise ValueError unless cp, offload and the dtype can run on this model and cluster."""
    if cfg.cp > 1 and profile.seq_len % (2 * cfg.cp):
        raise ValueError(
            f"cp = {cfg.cp} needs the sequence length ({profile.seq_len}) to be a multiple of "
            f"2 * cp = {2 * cfg.cp} (load-balanced ring attention: two chunks per rank)"
        )
    if cfg.offload != "none" and (cluster.host_memory_bytes_per_gpu <= 0
                                  or cluster.pcie_bytes_per_s <= 0):
        raise ValueError(
            f"offload {cfg.offload!r} needs the cluster's host_memory_bytes_per_gpu and "
            "pcie_bytes_per_s (the GPU presets have them); use offload='none'"
        )
    if cfg.dtype == "fp8" and cluster.device.peak_flops("fp8") <= 0:
        raise ValueError(
            f"dtype fp8 needs fp8 tensor cores; {cluster.device.name} has none (H100 and H200 "
            "do); use bf16"
        )


def check_ep(profile: ModelProfile, cfg: ParallelConfig) -> None:
    """Raise ValueError unless expert parallelism fits: a mixture-of-experts model, ep dividing
    dp * cp (experts shard over data/context-parallel ranks) and every layer's expert count."""
    if cfg.ep == 1:
        return
    experts = sorted({layer.moe.experts for layer in profile.layers if layer.moe is not None})
    if not experts:
        raise ValueError(
            f"ep = {cfg.ep} needs a mixture-of-experts model; {profile.name} has no experts "
            "(use ep=1)"
        )
    if (cfg.dp * cfg.cp) % cfg.ep:
        raise ValueError(
            f"ep = {cfg.ep} must divide dp * cp = {cfg.dp * cfg.cp} (experts are sharded over "
            "data-parallel ranks)"
        )
    for count in experts:
        if count % cfg.ep:
            raise ValueError(
                f"ep = {cfg.ep} must divide the number of experts ({count}); pick an ep that "
                f"divides {count}"
            )


def check_config(profile: ModelProfile, cluster: Cluster, config: ParallelConfig) -> None:
    """Raise ValueError naming the first constraint the config breaks on this model and cluster.

    Args:
        profile: the model profile.
        cluster: the cluster.
        config: the split to check.

    Raises:
        ValueError: world size, head divisibility, stage count, schedule or SP constraints.
    """
    cfg = config
    if cfg.world_size != cluster.num_gpus:
        raise ValueError(
            f"world size dp * cp * tp * pp = {cfg.dp} * {cfg.cp} * {cfg.tp} * {cfg.pp} = "
            f"{cfg.world_size} does not equal the cluster's {cluster.num_gpus} GPUs"
        )
    check_ep(profile, cfg)
    check_dimensions(profile, cluster, cfg)
    if cfg.tp > 1:
        for name, count in (("heads", profile.heads), ("kv_heads", profile.kv_heads)):
            if count and count % cfg.tp:
                raise ValueError(
                    f"tp = {cfg.tp} must divide the model's {name} = {count}; pick a tp that "
                    f"divides {count}"
                )
        for layer in profile.layers:
            for name, count in (("heads", layer.tp.heads), ("kv_heads", layer.tp.kv_heads)):
                if count and count % cfg.tp:
                    raise ValueError(
                        f"tp = {cfg.tp} must divide {name} = {count} of layer {layer.name}"
                    )
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ValueError("sequence_parallel needs tp > 1 (it shards activations over tp)")
    if cfg.pp > 1 and cfg.num_stages > profile.num_layers:
        raise ValueError(
            f"pp * virtual_stages = {cfg.num_stages} stages exceed the model's "
            f"{profile.num_layers} layers; lower pp or virtual_stages"
        )
    check_schedule(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches)
