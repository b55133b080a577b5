"""Norms that run in the residual stream's 16-bit dtype under autocast, as the profile counts.

``torch.autocast`` runs ``layer_norm`` (and, by its op lists, the pieces of an unfused RMSNorm) in
fp32 on CUDA: the norm's fp32 output is then cast to 16 bits separately by every projection that
reads it (three copies for q, k and v, each saved for backward), and an fp32 residual stream
(the embedding's output under fp32 parameters) makes every norm save an fp32 input. Measured on
an H200 (benchmarks/results/h200/): about 8 s b h extra saved bytes per GPT block, 12% of a
step's peak, absent from the 16-bit profile. Under autocast the zoo therefore casts the residual
stream to the autocast dtype once, after the embeddings (``Transformer.forward``), and its norms
run in that dtype with autocast disabled (their fp32 weights cast per call, ``h`` elements), as
a model trained in pure bf16 does (Megatron-LM's bf16 norms compute in fp32 inside the kernel and
return bf16). Without autocast (fp32 training, meta profiling) they are the plain torch norms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LayerNorm", "RMSNorm", "autocast_dtype", "to_autocast_dtype"]


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes ``x``'s device type in, or None when autocast is off there
    (and while torch.fx traces symbolically: ``x`` is then a Proxy and no autocast applies)."""
    if isinstance(x, torch.fx.Proxy):
        return None
    device_type = x.device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` cast to the autocast dtype of its device when autocast is on (else ``x``)."""
    dtype = autocast_dtype(x)
    if dtype is None or not x.is_floating_point() or x.dtype == dtype:
        return x
    return x.to(dtype)


def _cast(param: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if param is None else param.to(dtype)


class _AutocastDtypeNorm(nn.Module):
    """The forward both norms share: under autocast, ``_normalise`` in the autocast dtype with
    autocast off; otherwise the plain torch norm (the next class in the method order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its last dimension."""
        dtype = autocast_dtype(x)
        if dtype is None:
            plain: torch.Tensor = super().forward(x)
            return plain
        with torch.autocast(x.device.type, enabled=False):
            return self._normalise(x.to(dtype), dtype)

    def _normalise(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class LayerNorm(_AutocastDtypeNorm, nn.LayerNorm):
    """``nn.LayerNorm`` that, under autocast, runs in the autocast dtype (input and output)."""

    def _normalise(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, _cast(self.weight, dtype),
                            _cast(self.bias, dtype), self.eps)


class RMSNorm(_AutocastDtypeNorm, nn.RMSNorm):
    """``nn.RMSNorm`` that, under autocast, runs in the autocast dtype (input and output)."""

    def _normalise(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, _cast(self.weight, dtype), self.eps)
