"""Training precision: which dtypes a device runs fast, and fp8 matmuls' cost.

Units: FLOP/s, FLOPs, bytes. A device supports a 16-bit dtype when its tensor cores run it
faster than fp32 (V100: fp16 only, its bf16 runs at the fp32 rate; A100, H100, H200: bf16 and
fp16); fp8 when it has fp8 tensor cores (``DeviceSpec.peak_fp8_flops`` > 0: H100, H200). The
planner prefers bf16 (no loss scaling), fp16 where bf16 is slow, and tries fp8 where it runs.

fp8 (torchao ``Float8Linear``, tensorwise dynamic scaling; Transformer Engine alike) runs the
three GEMMs of every linear of the transformer blocks in fp8 and everything else (attention
core, norms, the embedding, the output head, as torchtitan's ``filter_fqns = ["output"]``
keeps it, the loss) in bf16. For one block and micro-batch with linear FLOPs F_mm and
attention-core FLOPs F_attn (``recompute_flops["selective"]``, what selective recompute
re-runs):

    t_matmul = F_mm / peak_fp8 + F_attn / peak_bf16         (both times the device efficiency)
    scaling  = FP8_CAST_BYTES_PER_ACT_BYTE * act_bytes + FP8_CAST_BYTES_PER_PARAM * params

The scaling overhead is memory traffic, by the framework's scaling recipe
(``Framework.fp8_scaling``):

- ``dynamic`` (torchao tensorwise): each GEMM operand is read once for its amax and again to
  cast it (bf16 read 2 + 2 bytes, fp8 write 1: 5 bytes per element, 2.5 per bf16 byte), for the
  linears' inputs in the forward and their output gradients in the backward (taken as the
  layer's saved activation bytes each), and for the weights once per micro-batch.
- ``delayed`` (Transformer Engine's DelayedScaling): the scale comes from the amax history and
  the amax is taken inside the cast kernel (read 2, write 1: 3 bytes per element, 1.5 per bf16
  byte); the fp8 weights are cast once per step and cached for the other micro-batches (TE
  user guide, "Performance Optimizations": FP8 weight caching).
Checked against torchao's documented end-to-end figures (torchao float8 README / training docs:
"up to 1.25x at 8 GPU / 8B", torchtitan Llama 3 8B on 8 H100, tensorwise with float8
all-gather 7,186 vs 5,760 bf16 tokens/s, 1.25x; tests/unit/test_cost_dims.py).
"""

from __future__ import annotations

from types import MappingProxyType

from autopar.config import base_dtype
from autopar.cost_model.hardware import DeviceSpec

__all__ = [
    "FP8_CAST_BYTES_PER_ACT_BYTE",
    "FP8_CAST_BYTES_PER_PARAM",
    "FP8_RECIPE_WORDS",
    "FP8_SCALINGS",
    "attention_peak_flops",
    "dtype_reason",
    "fp8_cast_bytes",
    "fp8_linears",
    "layer_peak_flops",
    "layer_rates",
    "supported_dtypes",
]

FP8_SCALINGS = ("dynamic", "delayed")
# How each scaling reads in a report: dynamic is torchao's Float8Linear tensorwise recipe or
# Transformer Engine's per-tensor current scaling; delayed is Transformer Engine's alone.
FP8_RECIPE_WORDS = MappingProxyType({
    "dynamic": "tensorwise dynamic scaling",
    "delayed": "Transformer Engine delayed scaling"})
# sourced (module docstring): bytes moved per bf16 byte of the linears' inputs, forward and
# backward together; dynamic: amax read + cast (2.5 per bf16 byte each way); delayed: the cast
# alone (1.5).
FP8_CAST_BYTES_PER_ACT_BYTE = MappingProxyType({"dynamic": 2 * 2.5, "delayed": 2 * 1.5})
# sourced: a weight's cast, bytes per parameter: dynamic 5 per micro-batch (amax read, cast);
# delayed 3 once per step (TE's cached fp8 weights).
FP8_CAST_BYTES_PER_PARAM = MappingProxyType({"dynamic": 5.0, "delayed": 3.0})


def fp8_linears(dtype: str, layer_kind: str) -> bool:
    """Whether a layer's linears run fp8: the blocks' under an fp8 split; the embedding, the
    output head and everything outside the linears stay 16-bit (module docstring)."""
    return dtype == "fp8" and layer_kind == "block"


def fp8_cast_bytes(scaling: str, act_bytes: float, params: float,
                   num_microbatches: int) -> tuple[float, float]:
    """(forward, backward) bytes one micro-batch's fp8 casts move for a layer with
    ``act_bytes`` of saved input activations and ``params`` parameters on this rank."""
    half = FP8_CAST_BYTES_PER_ACT_BYTE[scaling] / 2 * act_bytes
    weights = FP8_CAST_BYTES_PER_PARAM[scaling] * params
    if scaling == "delayed":
        weights /= max(1, num_microbatches)  # cast once per step, cached
    return half + weights, half


def supported_dtypes(device: DeviceSpec) -> tuple[str, ...]:
    """The dtypes the planner tries on ``device``, preferred first (module docstring)."""
    fast_bf16 = device.peak_bf16_flops > device.peak_fp32_flops
    fast_fp16 = device.peak_fp16_flops > device.peak_fp32_flops
    # No 16-bit tensor cores at all (CPU workers): bf16, the default, as fast as any.
    out = ["bf16"] if fast_bf16 or not fast_fp16 else ["fp16"]
    if device.peak_fp8_flops > 0 and fast_bf16:
        out.append("fp8")
    return tuple(out)


def layer_peak_flops(matmul_peak_flops: float, attention_peak_flops: float,
                     matmul_flops: float, attention_flops: float) -> float:
    """The rate at which a layer's FLOPs run: its linears at ``matmul_peak_flops`` (the
    training dtype's; fp8 linears at the fp8 rate), its attention core at
    ``attention_peak_flops`` (the 16-bit rate times its kernel's ``compute.attention_ratio``):
    a harmonic mean weighted by FLOPs."""
    if attention_flops <= 0 or attention_peak_flops == matmul_peak_flops:
        return matmul_peak_flops
    return (matmul_flops + attention_flops) / (max(0.0, matmul_flops) / matmul_peak_flops
                                               + attention_flops / attention_peak_flops)


def attention_peak_flops(device: DeviceSpec, dtype: str, attention_ratio: float) -> float:
    """The attention core's peak rate: the 16-bit rate of the training dtype (bf16 under fp8)
    times its kernel's speed (``compute.attention_ratio``)."""
    return device.peak_flops(base_dtype(dtype)) * attention_ratio


def layer_rates(device: DeviceSpec, dtype: str, flops: float, attention_flops: float, *,
                fp8_linears: bool, attention_ratio: float,
                selective_attention_only: bool) -> tuple[float, float]:
    """(the rate of a layer's ``flops``, its selective re-run's rate over it): the linears at
    the training dtype's rate (``fp8_linears``: the fp8 rate), the ``attention_flops`` of its
    attention core at the 16-bit rate times ``attention_ratio`` (``layer_peak_flops``); a
    selective mode that re-runs the attention core alone runs at the attention's own rate."""
    half = device.peak_flops(base_dtype(dtype))
    attention_peak = attention_peak_flops(device, dtype, attention_ratio)
    peak = layer_peak_flops(device.peak_fp8_flops if fp8_linears else half, attention_peak,
                            flops - attention_flops, attention_flops)
    selective = attention_peak / peak if selective_attention_only and attention_flops > 0 else 1.0
    return peak, selective


def _rate(flops: float) -> str:
    """A FLOP rate for the report: TFLOP/s, or GFLOP/s below 0.1 TFLOP/s (a CPU)."""
    if flops >= 1e14:
        return f"{flops / 1e12:.0f} TFLOP/s"
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e11 else f"{flops / 1e9:.1f} GFLOP/s"


def dtype_reason(device: DeviceSpec, dtype: str, fp8_scaling: str,
                 framework_dtypes: tuple[str, ...]) -> str:
    """Why a plan runs in ``dtype`` on ``device``, in words (the report's precision line); an
    fp8 plan names its framework's scaling (``Framework.fp8_scaling``: ``FP8_RECIPE_WORDS``), and
    fp16 is suggested only where the framework trains in it (``framework_dtypes``)."""
    bf16, fp16, fp32 = device.peak_bf16_flops, device.peak_fp16_flops, device.peak_fp32_flops
    if dtype == "fp8":
        return (f"fp8 matmuls at {_rate(device.peak_fp8_flops)} "
                f"({FP8_RECIPE_WORDS[fp8_scaling]}), attention and the rest in bf16 at "
                f"{_rate(bf16)}")
    if bf16 == fp16 == fp32:  # no 16-bit units (a CPU): every dtype at one rate
        return f"{dtype} at {_rate(fp32)} ({device.name} runs every dtype at this rate)"
    if dtype == "fp16":
        if bf16 <= fp32:
            return (f"fp16 with loss scaling: {device.name} has no bf16 tensor cores "
                    f"(bf16 {_rate(bf16)}, fp16 {_rate(fp16)})")
        return f"fp16 at {_rate(fp16)} (as asked)"
    if dtype == "bf16":
        if bf16 < fp16 and "fp16" not in framework_dtypes:
            return (f"bf16 at {_rate(bf16)}: {device.name} has no bf16 tensor cores, and the "
                    f"framework no fp16 (fp16 would run at {_rate(fp16)})")
        if bf16 < fp16:
            return (f"bf16 at {_rate(bf16)} (as asked): {device.name} has no bf16 tensor cores; "
                    f"fp16 runs at {_rate(fp16)} (--dtype fp16)")
        return f"bf16 at {_rate(bf16)} (fp16's speed without loss scaling)"
    return f"fp32 at {_rate(fp32)}"
