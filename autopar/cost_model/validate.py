"""Checks of a ParallelConfig against a model profile and a cluster (what the config alone can't).

Each rule is one ``*_problem`` function (the reason a degree cannot run, or None), which
``check_config`` raises as ``ValueError`` and the search's enumeration (``search/space.py``,
``search/dimensions.py``) uses to skip the same degrees. The micro-batch rules per schedule
(torch 2.13's ``torch.distributed.pipelining.schedules``) live in
``autopar.schedules.check_schedule``.
"""

from __future__ import annotations

from collections.abc import Iterable

from autopar.config import ParallelConfig
from autopar.cost_model.hardware import Cluster, DeviceSpec
from autopar.graph.types import ModelProfile
from autopar.schedules import check_schedule

__all__ = [
    "check_config",
    "check_dimensions",
    "check_ep",
    "check_inputs",
    "cp_problem",
    "dtype_problem",
    "ep_problem",
    "offload_problem",
    "sp_problem",
    "stages_problem",
    "tp_problem",
    "world_problem",
]


def check_inputs(caller: str, profile: object, *cluster: object) -> None:
    """A TypeError naming what ``caller`` takes, where its profile or (when it takes one) its
    cluster is something else (a dict, a name, None) that would fail deep inside with an
    AttributeError."""
    for value, kind, what in ((profile, ModelProfile, "a ModelProfile (autopar.profile(model))"),
                              *((c, Cluster, "a Cluster (autopar.Cluster.preset(...) or "
                                 "Cluster.from_yaml(...))") for c in cluster)):
        if not isinstance(value, kind):
            raise TypeError(f"{caller}() takes {what}, got {type(value).__name__}")


def cp_problem(cp: int, seq_len: int) -> str | None:
    """Load-balanced ring attention gives each cp rank two chunks: 2 cp divides the length."""
    if cp > 1 and seq_len % (2 * cp):
        return (f"cp = {cp} needs the sequence length ({seq_len}) to be a multiple of "
                f"2 * cp = {2 * cp} (load-balanced ring attention: two chunks per rank)")
    return None


def sp_problem(sequence_parallel: bool, tp: int, cp: int, seq_len: int | None) -> str | None:
    """Sequence parallelism shards each rank's sequence (seq_len / cp tokens) over the tp ranks
    (Megatron-LM's and DTensor's ``Shard(1)`` alike): tp > 1 and tp divides seq_len / cp.
    Without a sequence length (``seq_len`` None) only the first is checked."""
    if not sequence_parallel:
        return None
    if tp == 1:
        return "sequence_parallel needs tp > 1 (it shards activations over tp)"
    if seq_len is not None and (seq_len // cp) % tp:
        return (f"sequence parallelism with tp = {tp} needs seq_len / cp = {seq_len // cp} to be "
                f"a multiple of tp; pick a tp that divides {seq_len // cp}, or turn sequence "
                "parallelism off")
    return None


def offload_problem(offload: str, cluster: Cluster) -> str | None:
    """Offload needs the cluster's host memory and PCIe bandwidth per GPU."""
    if offload != "none" and (cluster.host_memory_bytes_per_gpu <= 0
                              or cluster.pcie_bytes_per_s <= 0):
        return (f"offload {offload!r} needs the cluster's host_memory_bytes_per_gpu and "
                "pcie_bytes_per_s (the GPU presets have them); use offload='none'")
    return None


def tp_problem(tp: int, counts: Iterable[tuple[str, int]]) -> str | None:
    """Sharded attention views heads as -1: tp divides every (name, head count) given."""
    for name, count in counts:
        if tp > 1 and count and count % tp:
            return f"tp = {tp} must divide {name} = {count}; pick a tp that divides {count}"
    return None


def stages_problem(num_stages: int, num_layers: int) -> str | None:
    """Every pipeline stage holds at least one profile layer."""
    if num_stages > 1 and num_stages > num_layers:
        return (f"pp * virtual_stages = {num_stages} stages exceed the model's {num_layers} "
                "layers; lower pp or virtual_stages")
    return None


def ep_problem(ep: int, experts: Iterable[int]) -> str | None:
    """ep divides every MoE layer's expert count (``experts``; ``check_ep`` refuses ep > 1
    without any). That it divides dp * cp, the ranks experts shard over, is ParallelConfig's own
    rule."""
    if ep == 1:
        return None
    for count in sorted(set(experts)):
        if count % ep:
            return (f"ep = {ep} must divide the number of experts ({count}); pick an ep that "
                    f"divides {count}")
    return None


def check_dimensions(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig) -> None:
    """Raise ValueError unless cp, offload and the dtype can run on this model and cluster."""
    problem = cp_problem(cfg.cp, profile.seq_len) or offload_problem(cfg.offload, cluster)
    if problem:
        raise ValueError(problem)
    problem = dtype_problem(cluster.device, cfg.dtype)
    if problem:
        raise ValueError(problem)


def dtype_problem(device: DeviceSpec, dtype: str) -> str | None:
    """Why ``device`` cannot train in ``dtype`` (None when it can)."""
    if dtype == "fp8" and device.peak_flops("fp8") <= 0:
        return (f"dtype fp8 needs fp8 tensor cores; {device.name} has none (H100 and H200 do); "
                "use bf16")
    return None


def world_problem(cfg: ParallelConfig, num_gpus: int) -> str | None:
    """Why the split's world size is not the cluster's GPU count, or None."""
    if cfg.world_size == num_gpus:
        return None
    return (f"world size dp * cp * tp * pp = {cfg.dp} * {cfg.cp} * {cfg.tp} * {cfg.pp} = "
            f"{cfg.world_size} does not equal the cluster's {num_gpus} GPUs")


def check_ep(profile: ModelProfile, cfg: ParallelConfig) -> None:
    """Raise ValueError unless expert parallelism fits (``ep_problem``)."""
    experts = [layer.moe.experts for layer in profile.layers if layer.moe is not None]
    if cfg.ep > 1 and not experts:
        raise ValueError(f"ep = {cfg.ep} needs a mixture-of-experts model; {profile.name} has "
                         "no experts (use ep=1)")
    problem = ep_problem(cfg.ep, experts)
    if problem:
        raise ValueError(problem)


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
    problem = world_problem(cfg, cluster.num_gpus)
    if problem:
        raise ValueError(f"{problem}; choose degrees whose product is {cluster.num_gpus}, or a "
                         f"cluster of {cfg.world_size} GPUs (--gpus {cfg.world_size})")
    check_ep(profile, cfg)
    check_dimensions(profile, cluster, cfg)
    counts = [("the model's heads", profile.heads), ("the model's kv_heads", profile.kv_heads)]
    for layer in profile.layers:
        counts += [(f"heads of layer {layer.name}", layer.tp.heads),
                   (f"kv_heads of layer {layer.name}", layer.tp.kv_heads)]
    problem = (tp_problem(cfg.tp, counts) or stages_problem(cfg.num_stages, profile.num_layers)
               or sp_problem(cfg.sequence_parallel, cfg.tp, cfg.cp, profile.seq_len))
    if problem:
        raise ValueError(problem)
    check_schedule(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches)
