"""Cluster description: devices, links, presets, YAML round-trip.

Units: FLOP/s, bytes, bytes/s, seconds. A ``Cluster`` is ``nodes`` x ``gpus_per_node`` identical
devices (``DeviceSpec``) joined by two link tiers (``LinkSpec``): inside a node (NVLink/NVSwitch)
and between nodes (the NIC share of one GPU). Link bandwidths are the *bus bandwidth* a ring
collective achieves per GPU per direction (NCCL's ``busbw``, reference/formulas.md section 6), not
the line rate: a ring all-reduce of S bytes over n ranks then takes ``2 (n-1)/n * S / bw``.

The GPU presets' values and their sources (fitted, sourced or measured) are in presets.py; what a
training framework changes on top of them is in frameworks.py (docs/frameworks.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from autopar.cost_model.presets import (
    ALLOCATOR_RESERVE_BYTES,
    COMM_BUFFER_BYTES_PER_GROUP,
    DP_OVERLAP,
    HEADROOM,
    PRESETS,
    cpu_cluster_fields,
    thaw,
)
from autopar.errors import ClusterConfigError
from autopar.units import GIB

__all__ = ["GPUS_PER_NODE", "MAX_GPUS", "MAX_GPU_MEMORY_GB", "MIN_RATE_PER_S", "Cluster",
           "DeviceSpec", "LinkSpec"]

# Bounds that keep every loop over a cluster's size short and every time finite: the largest
# training clusters built hold ~10^5 GPUs; a FLOP/s or byte/s rate below 10^6 (a 1990s CPU) is a
# typo, and one near 0 makes every predicted time infinite.
MAX_GPUS = 2**20
MIN_RATE_PER_S = 1e6
MAX_GPU_MEMORY_GB = 2**20  # 1 PiB a device
# sourced: an HGX / DGX A100, H100 or H200 node holds 8 GPUs (the presets' nodes; DESIGN.md's
# ``--gpus N`` alone means nodes of 8).
GPUS_PER_NODE = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU worker process).

    Attributes:
        name: part name, e.g. "A100-SXM4-80GB".
        peak_bf16_flops: dense bf16 peak FLOP/s (tensor cores, no sparsity).
        peak_fp16_flops: dense fp16 peak FLOP/s.
        peak_tf32_flops: dense tf32 peak FLOP/s.
        peak_fp32_flops: fp32 peak FLOP/s (what torch's default fp32 matmul runs at).
        memory_bytes: device memory in bytes.
        hbm_bytes_per_s: memory bandwidth in bytes/s (bounds elementwise ops and the optimizer).
        matmul_efficiency_max: fraction of peak that very large matmuls reach (fitted).
        matmul_half_flops: matmul work per layer per micro-batch per rank (FLOPs) at which the
            achieved efficiency is half of ``matmul_efficiency_max`` (fitted): small matrices, as
            tensor parallelism makes them, run further from peak.
        elementwise_traffic_factor: memory traffic of the non-matmul ops (norms, activations,
            dropout, residual adds, softmax) as a multiple of the bytes a layer saves for backward
            (fitted; read/written at ``hbm_bytes_per_s``).
        layer_overhead_s: fixed framework cost of one transformer block's forward + backward
            for one micro-batch (Python, operator dispatch, autograd, kernel launches; on CPU
            also the runtime's live-tensor counter), 1/3 forward, 2/3 backward. Measured by
            ``autopar calibrate`` on CPU, where it adds to the arithmetic; 0 on the GPU presets
            (there the host's dispatch runs ahead of the kernels: ``matmul_half_flops``).
        edge_layer_overhead_s: the same for each non-block layer (embedding; final norm, head
            and loss): half of the measured rest of a one-block model.
        tp_module_overhead_s: extra framework cost of one tensor-parallel module (a column- or
            row-parallel linear, a vocab-parallel embedding or head) per micro-batch when
            tp > 1, forward + backward (DTensor dispatch), 1/3 forward, 2/3 backward.
        fsdp_layer_overhead_s: extra framework cost of one FSDP2 unit (``fully_shard``, also
            under ``replicate()``) per micro-batch: pre/post-forward and backward hooks,
            copy-in/copy-out; forward + backward, 1/3 forward, 2/3 backward.
        optimizer_layer_overhead_s: fixed cost of one AdamW step over a block's parameters, per
            step (non-block layers: scaled by ``edge_layer_overhead_s / layer_overhead_s``).
        dtensor_optimizer_layer_overhead_s: extra cost of that step when the parameters are
            DTensors (tensor-parallel layers, FSDP2 / replicate() units), per block per step.
        recompute_layer_overhead_s: extra cost of a fully recomputed block per micro-batch
            (activation checkpointing: the re-run forward and its bookkeeping), replacing
            the re-run share of ``layer_overhead_s`` when larger; selective recompute pays it
            in proportion to the FLOPs it re-runs. Measured by calibrate on CPU.
        dispatch_floor_s: the host's time to issue one transformer block's forward + backward
            kernels in eager PyTorch (Python, dispatcher, autograd, launches). A GPU runs ahead
            of nothing: a block whose kernels take less than this takes this long (the GPU
            waits for the host), so a block's time is max(kernels, floor), 1/3 forward, 2/3
            backward. Measured per block by ``benchmarks/gpu_layer.py``; 0 on CPU, where the
            framework cost adds to the arithmetic (``layer_overhead_s``).
        shared_compute_processes: device processes that share one compute unit when all of
            them run (CPU workers over cores: workers / cores; a GPU: 1). The throughputs above
            are per process with all running; a process whose neighbours idle (a pipeline
            bubble) runs up to this many times faster.
        peak_fp8_flops: dense fp8 tensor-core peak FLOP/s; 0 for parts without fp8 tensor
            cores (fp8 training is then refused).
        flash2_attention_ratio: speed of FlashAttention-2 (the kernel of torch's SDPA flash
            backend) relative to the fused attention kernels (cuDNN, FlashAttention-3) that
            the device's matmul curve stands for; a framework whose ``attention_kernel`` is
            ``flash2`` runs a fused (SDPA) attention core at this fraction of the layer's rate
            (sourced per preset, presets.py).
    """

    name: str
    peak_bf16_flops: float
    peak_fp16_flops: float
    peak_tf32_flops: float
    peak_fp32_flops: float
    memory_bytes: int
    hbm_bytes_per_s: float
    matmul_efficiency_max: float
    matmul_half_flops: float
    elementwise_traffic_factor: float
    layer_overhead_s: float = 0.0
    edge_layer_overhead_s: float = 0.0
    tp_module_overhead_s: float = 0.0
    fsdp_layer_overhead_s: float = 0.0
    optimizer_layer_overhead_s: float = 0.0
    dtensor_optimizer_layer_overhead_s: float = 0.0
    recompute_layer_overhead_s: float = 0.0
    shared_compute_processes: float = 1.0
    dispatch_floor_s: float = 0.0
    peak_fp8_flops: float = 0.0
    flash2_attention_ratio: float = 1.0

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of a dtype ("bf16", "fp16", "fp32", "tf32" or "fp8": the fp8 matmul rate,
        0 where the part has no fp8 tensor cores)."""
        if dtype == "fp8":
            return self.peak_fp8_flops
        if dtype == "bf16":
            return self.peak_bf16_flops
        if dtype == "fp16":
            return self.peak_fp16_flops
        if dtype == "fp32":
            return self.peak_fp32_flops
        if dtype == "tf32":
            return self.peak_tf32_flops
        raise ValueError(f"unknown dtype {dtype!r}; use bf16, fp16, tf32, fp32 or fp8")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """One link tier, per GPU per direction.

    Attributes:
        bandwidth_bytes_per_s: achievable ring bus bandwidth per GPU (NCCL busbw), bytes/s.
        latency_s: latency of one ring step (alpha), seconds.
    """

    bandwidth_bytes_per_s: float
    latency_s: float


def _check_count(name: str, value: Any) -> None:
    """``nodes`` / ``gpus_per_node``: a whole number from 1 to MAX_GPUS (ClusterConfigError)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_GPUS:
        raise ClusterConfigError(
            f"cluster {name} must be a whole number from 1 to {MAX_GPUS:,}, got {value!r}")


# A Cluster's nested records, by field.
_SPECS: Mapping[str, type] = MappingProxyType(
    {"device": DeviceSpec, "intra_node": LinkSpec, "inter_node": LinkSpec})


def _misread(given: dict[str, Any], read: dict[str, Any], prefix: str = "") -> str | None:
    """Why ``given`` is not what ``cluster_fields.validate`` read it as (None when it is): a
    string for a number, a float for a whole number, another value."""
    for key, value in read.items():
        held = given.get(key)
        if isinstance(value, dict):
            found = _misread(held if isinstance(held, dict) else {}, value, f"{prefix}{key}.")
            if found:
                return found
        elif isinstance(held, int) and isinstance(value, float) and not isinstance(held, bool):
            continue  # an int for a rate: read as its float
        elif (held != value or isinstance(held, str) != isinstance(value, str)
              or (isinstance(value, int) and not isinstance(held, int))):
            kind = "a whole number" if isinstance(value, int) else (
                "a string" if isinstance(value, str) else "a number")
            return f"cluster field {prefix}{key} must be {kind}, got {held!r}"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """A homogeneous cluster: ``nodes`` x ``gpus_per_node`` devices and two link tiers.

    Attributes:
        name: preset name or a user label.
        nodes: number of nodes (>= 1).
        gpus_per_node: devices per node (>= 1).
        device: the device spec.
        intra_node: link between devices of one node.
        inter_node: the NIC share of one device for traffic between nodes.
        memory_headroom_fraction: fraction of device memory held back from the plan (CUDA
            context, allocator fragmentation); usable = memory_bytes * (1 - fraction).
        dp_overlap_efficiency: fraction of the last micro-batch's backward time usable to hide
            the data-parallel gradient reduction (presets: sourced, not fitted; ``autopar
            calibrate`` measures it on CPU).
        comm_buffer_bytes_per_group: device memory the communication library allocates per
            process group in use (NCCL channel buffers: 64 MiB; gloo on CPU: none as tensors).
        allocator_reserve_bytes: device memory held by the caching allocator beyond live
            tensors over a step (CUDA: 256 MiB; CPU: 0, the measured peak is live tensor bytes).
        param_traffic_factor: multiplier of the per-micro-batch memory traffic over the
            parameters (16-bit weight casts under autocast, fp32 gradient accumulation;
            ``compute.param_traffic_bytes_per_param``): 1 for autopar's runtime; 0 describes a
            runtime that keeps 16-bit weights and fuses the accumulation into the weight-gradient
            GEMM (Megatron-LM's gradient_accumulation_fusion).
        all_reduce_time_factor: measured over ring-model time of an all-reduce on this
            cluster's links (1 for the GPU presets; ``autopar calibrate`` fits it: gloo on CPU
            runs its collectives with their own algorithms).
        all_gather_time_factor: the same for all-gather.
        reduce_scatter_time_factor: the same for reduce-scatter (gloo: about 2).
        host_memory_bytes_per_gpu: host (CPU) memory per device that offloaded optimizer state
            or parameters may use (node memory / GPUs per node); 0: none described, offload is
            refused.
        pcie_bytes_per_s: host-device bandwidth per device per direction (PCIe); 0: none
            described, offload is refused.
    """

    name: str
    nodes: int
    gpus_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    memory_headroom_fraction: float = HEADROOM
    dp_overlap_efficiency: float = DP_OVERLAP
    comm_buffer_bytes_per_group: float = float(COMM_BUFFER_BYTES_PER_GROUP)
    allocator_reserve_bytes: float = float(ALLOCATOR_RESERVE_BYTES)
    param_traffic_factor: float = 1.0
    all_reduce_time_factor: float = 1.0
    all_gather_time_factor: float = 1.0
    reduce_scatter_time_factor: float = 1.0
    host_memory_bytes_per_gpu: float = 0.0
    pcie_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        from autopar.cost_model.cluster_fields import validate

        data = self.to_dict()
        # validate reads text data leniently ("312e12", 2.0 for a count); an object built in
        # Python must already hold what it reads: a value it would change is refused, and an
        # int in a rate's field is held as the float that a file read back gives (so the two
        # have one fingerprint).
        clean = validate(data)
        misread = _misread(data, clean)
        if misread:
            raise ClusterConfigError(misread)
        for key, value in clean.items():
            spec = _SPECS.get(key)
            object.__setattr__(self, key, spec(**value) if spec else value)

    @property
    def num_gpus(self) -> int:
        """Total devices: nodes * gpus_per_node."""
        return self.nodes * self.gpus_per_node

    @property
    def usable_memory_bytes(self) -> float:
        """Device memory a plan may use: memory_bytes * (1 - memory_headroom_fraction)."""
        return self.device.memory_bytes * (1.0 - self.memory_headroom_fraction)

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(
        cls,
        name: str,
        nodes: int = 1,
        gpus_per_node: int = GPUS_PER_NODE,
        gpu_memory_gb: float | None = None,
    ) -> Cluster:
        """A cluster of a known part (see ``list_presets()``).

        Args:
            name: preset name, e.g. "a100-80g", "h100", "cpu".
            nodes: number of nodes.
            gpus_per_node: devices per node (for "cpu": worker processes on this machine).
            gpu_memory_gb: override the device memory, in GB as vendors label parts (GiB), e.g.
                96 for the 96 GB H100 variants.

        Raises:
            ClusterConfigError: unknown preset or impossible values.
        """
        if not isinstance(name, str):
            raise TypeError(f"a cluster preset is named by a string, got {type(name).__name__}")
        _check_count("nodes", nodes)
        _check_count("gpus_per_node", gpus_per_node)  # before the cpu preset divides by it
        key = name.lower()
        fields: Mapping[str, Any]
        if key == "cpu":
            fields = cpu_cluster_fields(gpus_per_node)
        elif key in PRESETS:
            fields = PRESETS[key]
        else:
            raise ClusterConfigError(
                f"unknown cluster preset {name!r}; use one of {', '.join(cls.list_presets())} "
                "or describe the cluster in a YAML file"
            )
        data = thaw(fields)
        data.update(name=key, nodes=nodes, gpus_per_node=gpus_per_node)
        if gpu_memory_gb is not None:
            if isinstance(gpu_memory_gb, bool) or not isinstance(gpu_memory_gb, (int, float)):
                raise TypeError(f"gpu_memory_gb must be a number of GB, got {gpu_memory_gb!r}")
            if not 0 < gpu_memory_gb <= MAX_GPU_MEMORY_GB:  # also NaN and inf
                raise ClusterConfigError(
                    f"gpu_memory_gb must be above 0 and at most {MAX_GPU_MEMORY_GB} GB, got "
                    f"{gpu_memory_gb!r}"
                )
            data["device"]["memory_bytes"] = round(gpu_memory_gb * GIB)
        return cls.from_dict(data)

    @staticmethod
    def list_presets() -> tuple[str, ...]:
        """Names accepted by ``preset()``."""
        return (*sorted(PRESETS), "cpu")

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON/YAML-ready dict (nested dicts for the device and links)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """Build a Cluster from ``to_dict()`` output, validating every field.

        Raises:
            ClusterConfigError: naming the first missing, unknown or impossible field.
        """
        from autopar.cost_model.cluster_fields import validate

        clean = validate(data)
        return cls(**{**clean, **{key: spec(**clean[key]) for key, spec in _SPECS.items()}})

    def to_yaml_text(self) -> str:
        """The cluster as YAML text (``from_yaml`` reads it back)."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_yaml(self, path: str | Path) -> None:
        """Write the cluster as YAML to ``path``.

        Raises:
            ClusterConfigError: the file cannot be written (a directory, a missing folder).
        """
        try:
            Path(path).write_text(self.to_yaml_text())
        except OSError as e:
            raise ClusterConfigError(f"cannot write cluster file {path}: {e.strerror or e}; "
                                     "give a writable file path") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> Cluster:
        """Read a cluster YAML file written by ``to_yaml`` (or by hand).

        Raises:
            ClusterConfigError: unreadable file, bad YAML, or a missing/impossible field.
        """
        import yaml

        from autopar.cost_model.cluster_fields import load_yaml

        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ClusterConfigError(f"cannot read cluster file {path}: {e.strerror}") from e
        except UnicodeDecodeError:
            raise ClusterConfigError(f"cluster file {path} is not text (UTF-8 YAML); give a "
                                     "cluster YAML file") from None
        try:
            data = load_yaml(text)
        except yaml.YAMLError as e:
            raise ClusterConfigError(f"cluster file {path} is not valid YAML: {e}") from e
        except RecursionError:
            raise ClusterConfigError(f"cluster file {path} is nested too deeply; it is not a "
                                     "cluster description") from None
        except ValueError:  # an integer of more digits than Python converts (4,300)
            raise ClusterConfigError(f"cluster file {path} holds an integer of thousands of "
                                     "digits; fix the cluster file") from None
        if not isinstance(data, dict):
            raise ClusterConfigError(f"cluster file {path} must hold a mapping of fields")
        try:
            return cls.from_dict(data)
        except RecursionError:  # a deep value inside a field
            raise ClusterConfigError(f"cluster file {path} is nested too deeply; it is not a "
                                     "cluster description") from None

    def fingerprint(self) -> str:
        """Stable short hash (sha256 of the canonical JSON, first 16 hex digits). Fields added
        since plans were first saved (host memory, PCIe, fp8 peak) count only when set, so a
        plan saved before them still matches its cluster."""
        data = self.to_dict()
        for key in ("host_memory_bytes_per_gpu", "pcie_bytes_per_s"):
            if not data[key]:
                del data[key]
        if not data["device"]["peak_fp8_flops"]:
            del data["device"]["peak_fp8_flops"]
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]
