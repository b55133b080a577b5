"""Offload: optimizer state (and parameters) in host memory, the optimizer step on the CPU.

Units: bytes, seconds, parameters. What moves, per parameter a rank updates (its ZeRO shard,
n = dp_shard * cp ranks; w = bytes of the training dtype), as ZeRO-Offload (Ren et al. 2021,
arXiv:2101.06840, section 4) and FSDP2's ``CPUOffloadPolicy`` run it:

| offload   | device keeps                      | host keeps                 | copies          |
|-----------|-----------------------------------|----------------------------|-----------------|
| optimizer | w-byte shard (+ unsharded copies) | fp32 master, Adam, grads   | grads down,     |
|           |                                   |                            | w-byte shard up |
| params    | only gathered, unsharded copies   | the same (16 bytes)        | grads down, fp32|
|           |                                   |                            | shard up before |
|           |                                   |                            | each all-gather |

Host bytes are 16 per updated parameter (4 master + 8 Adam moments + 4 gradient). The gradient
copy down follows each reduction (it overlaps the backward as the reduce-scatter does: charged
like it, ``dp_comm.dp_terms``); with ``params`` the shard's copy up precedes each all-gather
and overlaps like it; with ``optimizer`` the updated w-byte shard goes up after the CPU step,
exposed. The CPU Adam step runs at ``CPU_ADAM_PARAMS_PER_S_PER_NODE`` shared by the node's
GPUs' processes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autopar.config import DTYPE_BYTES, ParallelConfig, dp_mechanism
from autopar.cost_model import comm, memory
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.memory import LayerState

__all__ = [
    "CPU_ADAM_PARAMS_PER_S_PER_NODE",
    "HOST_BYTES_PER_PARAM",
    "cpu_adam_s",
    "host_copies",
    "offload_state",
    "pcie_link",
    "run_offload",
]

# sourced: ZeRO-Offload (arXiv:2101.06840) Table 3: CPU-Adam updates 1 billion parameters in
# 1.18 s on a DGX-2 node's CPUs (2 x 24-core Xeon Platinum 8168), 5-6x faster than PyTorch's
# CPU Adam; taken per node and shared by the node's GPU processes.
CPU_ADAM_PARAMS_PER_S_PER_NODE = 1e9 / 1.18
HOST_BYTES_PER_PARAM = memory.MASTER_BYTES + memory.ADAM_BYTES + memory.GRAD_BYTES
_H2D, _D2H = comm.HOST_TO_DEVICE, comm.DEVICE_TO_HOST


def run_offload(config: ParallelConfig, fw: Any) -> str:
    """The offload framework ``fw`` really runs for ``config.offload``: ``optimizer`` as
    ``params`` where its optimizer offload keeps parameters and gradients on the host too
    (autopar's runtime: FSDP2 CPUOffloadPolicy for both, at any ZeRO stage;
    ``Framework.offload_optimizer_moves_params``)."""
    if config.offload == "optimizer" and fw.offload_optimizer_moves_params:
        return "params"
    return config.offload


def pcie_link(cluster: Cluster) -> comm.GroupLink:
    """One device's host link (the cluster's ``pcie_bytes_per_s``, no per-copy latency)."""
    return comm.GroupLink(size=1, bandwidth_bytes_per_s=max(cluster.pcie_bytes_per_s, 1.0),
                          latency_s=0.0, spans_nodes=False)


def offload_state(state: LayerState, config: ParallelConfig, params_tp: float,
                  mode: str | None = None) -> tuple[LayerState, float]:
    """(device-side state, host bytes) of one layer under ``config.offload``.

    Args:
        state: the layer's state without offload (``memory.layer_state``).
        config: the config.
        params_tp: the layer's parameters on this rank after tensor parallelism.
        mode: the offload run (``run_offload``); default ``config.offload``.
    """
    mode = mode or config.offload
    if mode == "none":
        return state, 0.0
    w = DTYPE_BYTES[config.dtype]
    shard = state.local_params
    unsharded = w * params_tp if memory.fsdp_keeps_params_unsharded(config) else 0.0
    host = HOST_BYTES_PER_PARAM * shard
    if mode == "optimizer":
        device = dataclasses.replace(state, param_bytes=w * shard + unsharded,
                                     optimizer_bytes=0.0)
        return device, host
    accumulated = memory.GRAD_BYTES * params_tp if memory.fsdp_accumulates_grads(config) else 0.0
    device = dataclasses.replace(state, param_bytes=unsharded, grad_bytes=accumulated,
                                 optimizer_bytes=0.0)
    return device, host


def host_copies(config: ParallelConfig, dp_calls: tuple[comm.Collective, ...],
                unit_params: float, mode: str | None = None) -> tuple[comm.Collective, ...]:
    """The host-device copies of one FSDP unit (axis "pcie"), mirroring its dp collectives.

    Args:
        config: the config.
        dp_calls: the unit's dp collectives (``dp_comm.dp_collectives``; may be empty).
        unit_params: the unit's parameters on this rank after tp (``fsdp_unit_params``).
        mode: the offload run (``run_offload``); default ``config.offload``.
    """
    mode = mode or config.offload
    if mode == "none" or unit_params <= 0:
        return ()
    n = config.shard_ranks if dp_mechanism(config) == "fsdp" else 1
    shard = unit_params / n

    def copy(kind: str, c_per: str, phase: str, calls: float) -> comm.Collective:
        return comm.Collective(kind=kind, axis="pcie", size_bytes=memory.GRAD_BYTES * shard,
                               calls=calls, per=c_per, phase=phase, counted=False)

    reductions = [c for c in dp_calls if c.kind != comm.ALL_GATHER
                  and c.axis == "dp"]
    out = [copy(_D2H, c.per, c.phase, c.calls) for c in reductions[:1]]
    if not out:
        out.append(copy(_D2H, "step", "backward", 1))
    if mode == "params":
        gathers = [c for c in dp_calls if c.kind == comm.ALL_GATHER]
        out += [copy(_H2D, c.per, c.phase, c.calls) for c in gathers] or [
            copy(_H2D, "microbatch", "forward", 1), copy(_H2D, "microbatch", "backward", 1)]
    return tuple(out)


def cpu_adam_s(cluster: Cluster, config: ParallelConfig, local_params: float,
               mode: str | None = None) -> float:
    """The offloaded optimizer step of ``local_params`` parameters, per step: the CPU Adam
    update plus (``optimizer`` offload; ``mode`` as in ``offload_state``) the updated w-byte
    shard's copy up."""
    rate = CPU_ADAM_PARAMS_PER_S_PER_NODE / cluster.gpus_per_node
    mode = mode or config.offload
    up = DTYPE_BYTES[config.dtype] * local_params if mode == "optimizer" else 0.0
    return local_params / rate + comm.host_copy_s(pcie_link(cluster), up)
