"""SDPA, dropout and RMSNorm as the GPU kernels run them, while profiling on the meta device.

Dropout: on CPU and meta, ``F.dropout`` multiplies by a noise tensor of the input's dtype and
saves it; the GPU kernel (``native_dropout``) saves a bool mask, 1 byte per element (Korthikanti's
count). While profiling, ``F.dropout`` in training runs as ``torch.native_dropout``.

RMSNorm: on CPU and meta, ``F.rms_norm`` decomposes into fp32 elementwise ops and keeps fp32
copies of its input; the fused GPU kernel keeps the input and the fp32 reciprocal RMS (one per
token). While profiling, ``F.rms_norm`` runs as a stand-in that saves exactly that.

SDPA, costed as the fused GPU kernel (flash / memory-efficient attention): on the meta device
torch runs ``scaled_dot_product_attention`` through its math path (which keeps
the s x s scores), and on CPU fake tensors ``FlopCounterMode`` counts nothing for the fused CPU
kernel, so neither trace describes what a GPU runs. While profiling, every call of
``F.scaled_dot_product_attention`` is replaced by ``_FusedSDPA``, an autograd function that
produces an output of the right shape without computing it and saves what the fused kernel saves:
q, k, v, the output and the log-sum-exp (``b * heads * s_q`` fp32). Its FLOPs are counted with the
formula below (all counts are FLOPs, multiply-add = 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["AttentionCall", "GpuKernelMode", "sdpa_fwd_flops"]


def sdpa_fwd_flops(q_shape: torch.Size, k_shape: torch.Size, v_shape: torch.Size) -> int:
    """Forward FLOPs of attention on q[..., heads, s_q, d], k[..., s_k, d], v[..., s_k, d_v].

    QK^T is ``2 * heads * s_q * s_k * d`` and attention-over-V ``2 * heads * s_q * s_k * d_v`` per
    batch entry, the full square (the causal mask is not exploited, as in Megatron-LM SC'21
    appendix: ``4 b s^2 h`` per layer when ``heads * d = h``).

    Args:
        q_shape: query shape (..., heads, s_q, d).
        k_shape: key shape (..., kv_heads, s_k, d).
        v_shape: value shape (..., kv_heads, s_k, d_v).

    Returns:
        The forward FLOPs.
    """
    batch_heads = math.prod(q_shape[:-2])
    s_q, d = q_shape[-2], q_shape[-1]
    s_k, d_v = k_shape[-2], v_shape[-1]
    return 2 * batch_heads * s_q * s_k * d + 2 * batch_heads * s_q * s_k * d_v


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionCall:
    """One intercepted SDPA call.

    Attributes:
        fwd_flops: forward FLOPs of the call (formula above).
        heads: query heads (dim -3 of q).
        kv_heads: key/value heads as passed to SDPA (dim -3 of k).
    """

    fwd_flops: int
    heads: int
    kv_heads: int


class _FusedSDPA(torch.autograd.Function):
    """Shape-only stand-in for the fused kernel: saves q, k, v, out, lse (and a mask if given)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        lead, heads, s_q = q.shape[:-3], q.shape[-3], q.shape[-2]
        d_v = v.shape[-1]
        # NOTE: the GPU kernels write the output as (..., s_q, heads, d_v) and return it
        # transposed, so the usual out.transpose(1, 2).reshape(b, s, h) after SDPA is a view: the
        # out-projection's saved input shares the kernel's saved output.
        out = q.new_empty((*lead, s_q, heads, d_v)).transpose(-3, -2)
        lse = q.new_empty((*lead, heads, s_q), dtype=torch.float32)
        if mask is None:
            ctx.save_for_backward(q, k, v, out, lse)
        else:
            ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.mark_non_differentiable(lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class _FusedRMSNorm(torch.autograd.Function):
    """Shape-only stand-in for the fused RMSNorm kernel: saves the input and fp32 1/rms."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, num_dims: int
    ) -> torch.Tensor:
        rstd = x.new_empty((*x.shape[: x.dim() - num_dims], *([1] * num_dims)), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, weight, _ = ctx.saved_tensors
        grad_w = None if weight is None else torch.empty_like(weight)
        return torch.empty_like(x), grad_w, None


class GpuKernelMode(TorchFunctionMode):
    """Run SDPA and RMSNorm as fused-kernel stand-ins, dropout as ``native_dropout``; log SDPA.

    Args:
        on_call: called with each ``AttentionCall``, and entered as a context manager factory via
            ``core`` around the stand-in so the caller can tag what the kernel saves.
        core: a zero-argument callable returning a context manager active while the kernel's
            tensors are saved (the saved-tensor recorder marks them as the attention core).
        fused_rms_norm: replace ``F.rms_norm`` by the fused kernel's stand-in (GPU); False
            leaves torch's composite, which CPU runs: it also keeps the normalised input
            (x * 1/rms, the operand of the weight product), one [b, s, h] more per norm.
    """

    def __init__(
        self,
        on_call: Callable[[AttentionCall], None],
        core: Callable[[tuple], Any],
        *,
        fused_rms_norm: bool = True,
    ) -> None:
        super().__init__()
        self._on_call = on_call
        self._core = core
        self._fused_rms_norm = fused_rms_norm

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        if func is F.rms_norm and self._fused_rms_norm:
            return self._rms_norm(*args, **kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask")
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        q, k, v = bound["query"], bound["key"], bound["value"]
        if q.dim() < 3:  # no heads dimension: not the transformer case, run as traced
            return func(*args, **kwargs)
        mask = bound.get("attn_mask")
        self._on_call(
            AttentionCall(
                fwd_flops=sdpa_fwd_flops(q.shape, k.shape, v.shape),
                heads=int(q.shape[-3]),
                kv_heads=int(k.shape[-3]) if k.dim() >= 3 else 1,
            )
        )
        inputs = (q, k, v) if mask is None else (q, k, v, mask)
        with self._core(inputs):
            return _FusedSDPA.apply(q, k, v, mask)

    @staticmethod
    def _dropout(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if not training or p <= 0.0 or p >= 1.0:
            return F.dropout(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    @staticmethod
    def _rms_norm(
        input: torch.Tensor,
        normalized_shape: Any,
        weight: torch.Tensor | None = None,
        eps: float | None = None,
    ) -> torch.Tensor:
        num_dims = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
        out = _FusedRMSNorm.apply(input, weight, num_dims)
        if weight is not None:  # the kernel's weight product, for graph/recorder.py's weight ops:
            with torch.no_grad():  # after the Function's saves (packed as it returns), which
                _ = out.detach() * weight  # are the norm's own, not what follows it
        return out
