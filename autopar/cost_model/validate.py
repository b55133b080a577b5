"""Checks of a ParallelConfig against a model profile and a cluster (what the config alone can't).

Each failed check raises ``ValueError`` whose message names the constraint and what to do. The
micro-batch rules per schedule (torch 2.13's ``torch.distributed.pipelining.schedules``) live in
``autopar.schedules.check_schedule``.
"""

from __future__ import annotations

from autopar.config import ParallelConfig
from autopar.cost_model.hardware import Cluster
from autopar.graph.types import ModelProfile
from autopar.schedules import check_schedule

__all__ = ["check_config", "check_dimensions", "check_ep"]


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
