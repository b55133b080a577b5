"""Cluster presets: datasheet and measured numbers for common parts, with their sources.

Units: FLOP/s, bytes, bytes/s, seconds. Link bandwidths are achievable ring bus bandwidths per GPU
per direction (NCCL busbw), reference/formulas.md sections 6-7. Memory sizes are what the driver
reports (vendors' "80GB" parts hold 80 GiB). ``Cluster.preset`` adds nodes and GPUs per node.

Compute efficiency (``matmul_efficiency_max``, ``elementwise_traffic_factor``) comes from one
joint fit to the 13 runs of the first calibration set (now records of
benchmarks/data/published_runs.json: docs/cost_model.md); each framework's own fields are fitted
on top of these curves (docs/frameworks.md). The half-work
point is fitted as a time (``MATMUL_HALF_S``: the per-layer fixed cost of launching and draining
matmul kernels) and converted to FLOPs with each part's peak, so parts without calibration
records (V100, H200) inherit the same physics.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from autopar.units import GIB, MIB

__all__ = [
    "ALLOCATOR_RESERVE_BYTES",
    "COMM_BUFFER_BYTES_PER_GROUP",
    "CPU_CORES",
    "DP_OVERLAP",
    "DP_OVERLAP_FIT",
    "HEADROOM",
    "PRESETS",
    "cpu_cluster_fields",
    "preset_for_device_name",
    "thaw",
]

# ---- fitted once, jointly, to the first 13 published runs (docs/cost_model.md) -----------------
# by the first round's calibration; no script in benchmarks/ refits these three now. They are the
# base each framework's kernel_efficiency scales (benchmarks/calibration.py --fit: 0.97-0.99 for
# torchtitan and Megatron-LM, whose records include those 13): a change here moves those fits.
A100_EFFICIENCY_MAX = 0.746  # fraction of 312 TFLOP/s large 16-bit matmuls reach (fitted)
H100_EFFICIENCY_MAX = 0.618  # fraction of 989 TFLOP/s (fitted; H100 runs further from its peak)
# Work (as seconds at peak) per layer and micro-batch at which matmul efficiency is half its max:
# about 1 GFLOP per GEMM (5 GEMMs a layer), where cuBLAS reaches roughly half its large-size
# throughput on A100. Physics, not fitted: every calibration run's layers are far larger.
MATMUL_HALF_S = 2.0e-5
ELEMENTWISE_TRAFFIC = 7.66  # non-matmul HBM traffic / bytes saved for backward (fitted)
# Usable fraction of the last backward for hiding the DP reduction (the mechanism: DDP's bucketed
# all-reduce launched as gradients are ready, the last bucket exposed; Li et al., "PyTorch
# Distributed", VLDB 2020). Shared by the GPU presets and the framework records, so fitted over
# every framework's records at once: the value of 0.6-1.0 with the lowest leave-one-source-out
# median error (0.8: 5.6%; 0.7 and 0.9: 5.8%; 0.6: 6.3%; 1.0: 6.6%).
DP_OVERLAP = 0.8
DP_OVERLAP_FIT = ("fitted: benchmarks/calibration.py --fit-dp-overlap (shared by all "
                  "frameworks; leave-one-source-out median 5.6% at 0.8, 5.8% at 0.7 and 0.9)")
# Measured on one H200 (benchmarks/gpu_layer.py; 96 blocks of 8 zoo models, bf16, tp 1-8,
# micro-batch 1-4, torch 2.11 eager; table in benchmarks/results/gpu_layer_h200.md): the best fit
# of the block-time curve is eff_max 0.70, half-efficiency work 3.7e10 FLOPs and a 2.0 ms floor
# per block forward + backward (the host's eager dispatch; small blocks at high tp measured
# 1.5-3 ms whatever their FLOPs), block-time MAPE 6.5% (the H100 fit above gave 17.3%).
H200_EFFICIENCY_MAX = 0.70
H200_HALF_FLOPS = 3.7e10
# sourced: FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) Figure 5, H100 SXM5 bf16
# forward, head dim 128, causal: FlashAttention-2 333 / 335 TFLOP/s at 8k / 16k tokens, cuDNN
# 529 / 539 (FlashAttention-3 602 / 616): FA2 runs at 0.63 of the fused kernels on Hopper. The
# H100 curve above was fitted to runs of fused-attention frameworks (and long-sequence
# Megatron-LM runs, whose attention is nearly all the work, hold at the matmul rate), so FA2's
# share is 0.63 of it. The H200 curve was measured on autopar's runtime, whose attention is
# SDPA's FA2 (torch 2.13: flash backend first, FA3 off): FA2's rate is already inside it (1.0).
H100_FLASH2_ATTENTION_RATIO = 0.63
DISPATCH_FLOOR_S = 2.0e-3  # eager PyTorch, one block forward + backward (any GPU's host)
# Sourced (not fitted): the share of device memory no plan may use: the CUDA context and
# cuBLAS / NCCL workspaces (~0.5-1 GiB on an 80 GB part, PyTorch's CUDA notes), the rest left
# for allocator reserve; fragmentation of churning memory is charged separately
# (Framework.fragmentation_fraction).
HEADROOM = 0.05
# NCCL allocates its channel buffers per communicator (NCCL_BUFFSIZE 4 MiB per channel and
# peer; ~16 ring channels on NVLink): ~64 MiB per process group in use (tp, dp, pp with degree > 1).
COMM_BUFFER_BYTES_PER_GROUP = 64 * MIB
# DDP's buckets (25 MiB each, gradient copies) are charged as gradients. The caching allocator's
# rounding and block splitting over the step (beyond the cluster's headroom fraction, which holds
# the CUDA context and long-term fragmentation): a fixed reserve. Sourced as an order of
# magnitude, not fitted (no record gives the bytes to fit it on): torch's CUDACachingAllocator
# serves requests under 10 MiB from 2 MiB or 20 MiB segments (kSmallBuffer / kLargeBuffer in
# c10/cuda/CUDACachingAllocator.cpp), and a dozen partly used 20 MiB segments are ~256 MiB.
ALLOCATOR_RESERVE_BYTES = 256 * MIB


def _gpu(
    name: str,
    *,
    bf16: float,
    fp16: float,
    tf32: float,
    fp32: float,
    memory_bytes: int,
    hbm: float,
    eff: float,
    half_flops: float | None = None,
    fp8: float = 0.0,
    flash2: float = 1.0,
) -> dict[str, Any]:
    return {
        "name": name,
        "peak_bf16_flops": bf16,
        "peak_fp16_flops": fp16,
        "peak_tf32_flops": tf32,
        "peak_fp32_flops": fp32,
        "memory_bytes": memory_bytes,
        "hbm_bytes_per_s": hbm,
        "matmul_efficiency_max": eff,
        "matmul_half_flops": half_flops or MATMUL_HALF_S * max(bf16, fp16),
        "elementwise_traffic_factor": ELEMENTWISE_TRAFFIC,
        "dispatch_floor_s": DISPATCH_FLOOR_S,
        "peak_fp8_flops": fp8,
        "flash2_attention_ratio": flash2,
    }


def _host(memory_bytes_per_node: float, gpus_per_node: int, pcie: float) -> dict[str, float]:
    return {"host_memory_bytes_per_gpu": memory_bytes_per_node / gpus_per_node,
            "pcie_bytes_per_s": pcie}


def _link(bw: float, latency: float) -> dict[str, float]:
    return {"bandwidth_bytes_per_s": bw, "latency_s": latency}


# A100 SXM4: 312 TFLOP/s dense bf16/fp16, 156 tf32, 19.5 fp32 (NVIDIA A100 datasheet; Megatron-LM
# SC'21 section 5). HBM2e 2,039 GB/s (80GB) and HBM2 1,555 GB/s (40GB) (A100 datasheet).
# NVLink3/NVSwitch: ~230 GB/s all-reduce busbw at large sizes (sjeaugey, NVIDIA/nccl-tests#149).
# IB: DGX-A100 8 x HDR 200 Gb/s -> 192 GB/s busbw per node = 24 GB/s per GPU (NVIDIA/nccl#812).
# Latencies: ~5 us per NVLink ring step, ~10 us per IB ring step (typical NCCL small-message
# figures; an assumption, they matter only for small messages).
_A100_NVLINK = _link(230e9, 5e-6)
_HDR_IB = _link(24e9, 10e-6)
# H100 SXM: 989 TFLOP/s dense bf16/fp16, 494.5 tf32 ("one-half lower without sparsity",
# torchtitan utils.py at 3faaa1a0), 67 fp32 (H100 datasheet); HBM3 3.35 TB/s (datasheet).
# NVLink4: ~370 GB/s busbw for ring collectives (sjeaugey, NVIDIA/nccl-tests#212).
# NDR 400 Gb/s per GPU: 46-48 GB/s measured per NIC (NVIDIA/nccl-tests#290).
_H100_NVLINK = _link(370e9, 5e-6)
_NDR_IB = _link(47e9, 10e-6)
# V100 SXM2 32GB: 125 TFLOP/s fp16 tensor cores; no bf16 or tf32 tensor cores, so those run at
# the 15.7 TFLOP/s fp32 rate (V100 datasheet); HBM2 900 GB/s (datasheet). NVLink2: 6 links x
# 25 GB/s per direction = 150 GB/s line rate; busbw taken as 80% of it (assumption, the same
# ratio as A100's 230/300). Inter-node: ZeRO's DGX-2 cluster had 800 Gb/s per 16-GPU node
# = 6.25 GB/s per GPU (Rajbhandari et al. 2020, section 10).
_V100_NVLINK = _link(120e9, 5e-6)
_V100_IB = _link(6.25e9, 10e-6)
# fp8: H100 SXM and H200 SXM 1,979 TFLOP/s dense fp8 tensor cores (H100 and H200 datasheets:
# 3,958 with sparsity); A100 and V100 have none.
# Host memory and PCIe per GPU, from the DGX system the presets' nodes are (spec sheets): DGX
# A100 1 TB system memory for 8 GPUs (DGX A100 datasheet: 1 TB, 2 TB on the 640 GB model), PCIe
# Gen4 x16 per GPU, 32 GB/s per direction (A100 datasheet: "PCIe Gen4 64 GB/s", both
# directions); DGX H100 and DGX H200 2 TB for 8 GPUs (datasheets), PCIe Gen5 x16, 64 GB/s per
# direction (H100 / H200 datasheets: "PCIe Gen5 128 GB/s"); DGX-2 (V100 SXM3 32 GB, the ZeRO
# papers' node) 1.5 TB for 16 GPUs (DGX-2 datasheet), PCIe Gen3 x16, 16 GB/s per direction
# (V100 datasheet: "PCIe 32 GB/s"). Line rates: what a pinned-memory copy approaches.
_A100_HOST = _host(1e12, 8, 32e9)
_H100_HOST = _host(2e12, 8, 64e9)
_V100_HOST = _host(1.5e12, 16, 16e9)


def _frozen(value: Any) -> Any:
    """A read-only deep copy: mappings become MappingProxyType (lists, tuples)."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A mutable deep copy of a (frozen) preset: mappings become dicts, tuples lists."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


# Fields every GPU preset shares (the cluster-level defaults of a GPU cluster).
_GPU_CLUSTER_DEFAULTS: dict[str, Any] = {
    "memory_headroom_fraction": HEADROOM,
    "dp_overlap_efficiency": DP_OVERLAP,
}


def _node(intra_node: dict[str, float], inter_node: dict[str, float],
          host: dict[str, float]) -> dict[str, Any]:
    """The links and host of one kind of node, with the GPU cluster defaults."""
    return {"intra_node": intra_node, "inter_node": inter_node, **host, **_GPU_CLUSTER_DEFAULTS}


_A100_NODE = _node(_A100_NVLINK, _HDR_IB, _A100_HOST)
_H100_NODE = _node(_H100_NVLINK, _NDR_IB, _H100_HOST)
_V100_NODE = _node(_V100_NVLINK, _V100_IB, _V100_HOST)

_A100_40G = _gpu(
    "A100-SXM4-40GB", bf16=312e12, fp16=312e12, tf32=156e12, fp32=19.5e12,
    memory_bytes=40 * GIB, hbm=1.555e12, eff=A100_EFFICIENCY_MAX,
)
# The 80 GB A100 differs from the 40 GB one in memory and HBM bandwidth only (A100 datasheet).
_A100_80G = {**_A100_40G, "name": "A100-SXM4-80GB", "memory_bytes": 80 * GIB,
             "hbm_bytes_per_s": 2.039e12}
# H100 SXM5 80GB: nvidia-smi reports 81,559 MiB.
_H100 = _gpu(
    "H100-SXM5-80GB", bf16=989e12, fp16=989e12, tf32=494.5e12, fp32=67e12,
    memory_bytes=81559 * MIB, hbm=3.35e12, eff=H100_EFFICIENCY_MAX, fp8=1979e12,
    flash2=H100_FLASH2_ATTENTION_RATIO,
)
# H200 SXM 141GB: same compute as H100 SXM (H200 datasheet: 989 TFLOP/s dense bf16),
# HBM3e 4.8 TB/s; nvidia-smi reports 143,771 MiB. Efficiency measured on one H200.
_H200 = {**_H100, "name": "H200-SXM-141GB", "memory_bytes": 143771 * MIB,
         "hbm_bytes_per_s": 4.8e12, "matmul_efficiency_max": H200_EFFICIENCY_MAX,
         "matmul_half_flops": H200_HALF_FLOPS, "flash2_attention_ratio": 1.0}
# No calibration record: efficiency as A100 (assumption).
_V100 = _gpu(
    "V100-SXM2-32GB", bf16=15.7e12, fp16=125e12, tf32=15.7e12, fp32=15.7e12,
    memory_bytes=32 * GIB, hbm=0.9e12, eff=A100_EFFICIENCY_MAX,
)

PRESETS: Mapping[str, Mapping[str, Any]] = _frozen({
    "a100-40g": {"device": _A100_40G, **_A100_NODE},
    "a100-80g": {"device": _A100_80G, **_A100_NODE},
    "h100": {"device": _H100, **_H100_NODE},
    "h200": {"device": _H200, **_H100_NODE},
    "v100-32g": {"device": _V100, **_V100_NODE},
})


def preset_for_device_name(device_name: str) -> str:
    """The GPU preset whose datasheet figures a device of this CUDA name starts from (the first
    matching part; an A100 named 40GB gets the 40 GB preset; an unknown part: "h100")."""
    name = device_name.upper()
    for key, preset in (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80g"),
                        ("V100", "v100-32g")):
        if key in name:
            return "a100-40g" if preset == "a100-80g" and "40GB" in name else preset
    return "h100"


# ---- cpu: this machine (2 cores of an AMD EPYC Zen 3, 23.5 GiB RAM), gloo over loopback -------
CPU_CORES = 2
# Zen 3 core: 2 x 256-bit FMA pipes = 32 fp32 FLOP/cycle; at ~3.0 GHz that is 96 GFLOP/s per core.
# Measured here: a 2048^3 fp32 matmul on 2 threads ran at 167 GFLOP/s (87% of 2 x 96).
CPU_CORE_FP32_FLOPS = 96e9
# No bf16/fp16 matmul units on Zen 3 (AVX2 only): 16-bit matmuls convert to fp32, no faster.
CPU_HOST_MEMORY_BYTES = 24684092 * 1024  # /proc/meminfo MemTotal of this machine
CPU_MEMORY_BYTES_PER_S = 36e9  # measured: 64 MiB tensor copy on 2 threads, 36 GB/s read+write
# gloo all_reduce over loopback (reference/runtime_notes.md, "Collective micro-benchmarks"):
# alpha-beta fits per process count. Ring all-reduce = 2(n-1) steps moving 2(n-1)/n S bytes:
# busbw = algbw * 2(n-1)/n and per-step latency = alpha / (2(n-1)).
#   N=2: alpha 0.37 ms, algbw 1.8 GB/s  -> busbw 1.8 GB/s,  step latency 0.185 ms
#   N=4: alpha 5 ms,    algbw 0.9 GB/s  -> busbw 1.35 GB/s, step latency 0.83 ms
#   N=8: alpha 16 ms,   algbw 0.5 GB/s  -> busbw 0.875 GB/s, step latency 1.14 ms
_CPU_LINKS: dict[int, tuple[float, float]] = {
    1: (1.8e9, 0.185e-3),
    2: (1.8e9, 0.185e-3),
    4: (1.35e9, 0.83e-3),
    8: (0.875e9, 1.14e-3),
}


def cpu_cluster_fields(workers: int) -> dict[str, Any]:
    """The "cpu" preset for ``workers`` gloo processes on this machine's 2 cores.

    Each worker runs one thread (OMP_NUM_THREADS=1): it gets a whole core while workers <= 2 and
    2 / workers of a core beyond that; the host memory is shared equally.
    """
    workers = max(1, int(workers))
    cores = min(1.0, CPU_CORES / workers)
    flops = CPU_CORE_FP32_FLOPS * cores
    key = min(_CPU_LINKS, key=lambda n: (abs(n - workers), n))
    bw, latency = _CPU_LINKS[key]
    device = {
        "name": "cpu-worker",
        "peak_bf16_flops": flops,
        "peak_fp16_flops": flops,
        "peak_tf32_flops": flops,
        "peak_fp32_flops": flops,
        "memory_bytes": CPU_HOST_MEMORY_BYTES // workers,
        "hbm_bytes_per_s": CPU_MEMORY_BYTES_PER_S * min(1.0, workers / CPU_CORES) / workers,
        # CPU matmuls: torch's tiny-model steps are dominated by per-op overhead (~10 us per op);
        # not fitted to GPU records. Max 0.87 as measured above; half point 1e-4 s of work, a
        # default until `autopar calibrate` measures it (calibration.calibration_to_cluster
        # sets the half point from the measured fixed cost of a matmul call).
        "matmul_efficiency_max": 0.87,
        "matmul_half_flops": 1e-4 * flops,
        "elementwise_traffic_factor": ELEMENTWISE_TRAFFIC,
        # Workers beyond the cores take turns on them: alone, a worker runs this much faster.
        "shared_compute_processes": max(1.0, workers / CPU_CORES),
    }
    return {
        "device": device,
        "intra_node": _link(bw, latency),
        "inter_node": _link(bw, latency),
        # Assumed, not fitted: the host's memory is shared with the OS and other processes, and
        # only CPU runs read it (a plan that fits keeps a fifth of it free).
        "memory_headroom_fraction": 0.2,
        "dp_overlap_efficiency": 0.0,  # gloo work runs on the same cores: no overlap
        # gloo allocates no tensors for its channels and CPU tensors are freed to the system
        # allocator at once: a CPU run's peak is its live tensor bytes (docs/verify.md).
        "comm_buffer_bytes_per_group": 0.0,
        "allocator_reserve_bytes": 0.0,
    }
