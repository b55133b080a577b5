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

The scaling overhead is memory traffic: dynamic scaling reads each GEMM operand once for its
amax and again to cast it (bf16 read 2 + 2 bytes, fp8 write 1: 5 bytes per element, 2.5 per
bf16 byte), for the linears' inputs in the forward and their output gradients in the backward
(taken as the layer's saved activation bytes each), and for the weights once per micro-batch.
Checked against torchao's documented end-to-end figures (torchao float8 README / training docs:
"up to 1.25x at 8 GPU / 8B", torchtitan Llama 3 8B on 8 H100, tensorwise with float8
all-gather 7,186 vs 5,760 bf16 tokens/s, 1.25x; tests/unit/test_cost_dims.py).
"""

from __future__ import annotations

from autopar.cost_model.hardware import DeviceSpec

__all__ = [
    "FP8_CAST_BYTES_PER_ACT_BYTE",
    "FP8_CAST_BYTES_PER_PARAM",
    "dtype_reason",
    "fp8_peak_flops",
    "supported_dtypes",
]

# sourced: dynamic scaling's amax read and cast (read 2, read 2, write 1 bytes per bf16
# element): 2.5 bytes per bf16 byte, forward (inputs) and backward (output gradients).
FP8_CAST_BYTES_PER_ACT_BYTE = 2 * 2.5
# sourced: the weight's amax read and cast per micro-batch, 5 bytes per bf16 parameter.
FP8_CAST_BYTES_PER_PARAM = 5.0


def supported_dtypes(device: DeviceSpec) -> tuple[str, ...]:
    """The dtypes the planner tries on ``device``, preferred first (module docstring)."""
    fast_bf16 = device.peak_bf16_flops > device.peak_fp32_flops
    fast_fp16 = device.peak_fp16_flops > device.peak_fp32_flops
    # No 16-bit tensor cores at all (CPU workers): bf16, the default, as fast as any.
    out = ["bf16"] if fast_bf16 or not fast_fp16 else ["fp16"]
    if device.peak_fp8_flops > 0 and fast_bf16:
        out.append("fp8")
    return tuple(out)


def fp8_peak_flops(device: DeviceSpec, matmul_flops: float, attention_flops: float) -> float:
    """The rate at which a layer's FLOPs run under fp8: linears at the fp8 rate, the attention
    core at bf16 (a harmonic mean weighted by FLOPs)."""
    total = matmul_flops + attention_flops
    if total <= 0:
        return device.peak_fp8_flops
    return total / (matmul_flops / device.peak_fp8_flops
                    + attention_flops / device.peak_bf16_flops)


def dtype_reason(device: DeviceSpec, dtype: str) -> str:
    """Why a plan runs in ``dtype`` on ``device``, in words (the report's precision line)."""
    tera = 1e12
    if dtype == "fp8":
        return (f"fp8 matmuls at {device.peak_fp8_flops / tera:.0f} TFLOP/s (torchao float8, "
                f"tensorwise scaling), attention and the rest in bf16 at "
                f"{device.peak_bf16_flops / tera:.0f}")
    if dtype == "fp16":
        if device.peak_bf16_flops <= device.peak_fp32_flops:
            return (f"fp16 with loss scaling: {device.name} has no bf16 tensor cores "
                    f"(bf16 {device.peak_bf16_flops / tera:.1f}, fp16 "
                    f"{device.peak_fp16_flops / tera:.0f} TFLOP/s)")
        return f"fp16 at {device.peak_fp16_flops / tera:.0f} TFLOP/s (as asked)"
    if dtype == "bf16":
        return (f"bf16 at {device.peak_bf16_flops / tera:.0f} TFLOP/s (fp16's speed without "
                "loss scaling)")
    return f"fp32 at {device.peak_fp32_flops / tera:.1f} TFLOP/s"
