"""Llama style model: RMSNorm, RoPE, SwiGLU feed-forward, grouped-query attention, no biases.

Parameters: per block ``2 h^2 + 2 h (kv_heads * head_dim) + 3 h f + 2h`` (wq, wo; wk, wv; w1, w2,
w3 of inner width f; two RMSNorm weights); token embedding ``V h``; final RMSNorm ``h``; untied
head ``V h`` (a tied head adds nothing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.attention import Attention
from autopar.models.moe import MoE
from autopar.models.norms import RMSNorm
from autopar.models.spec import ModelSpec
from autopar.models.transformer import Transformer

__all__ = ["NORM_EPS", "LlamaBlock", "SwiGLU", "build_llama"]

# RMSNorm epsilon of Llama 2 / Llama 3 (their params.json: norm_eps 1e-5).
NORM_EPS = 1e-5


class SwiGLU(nn.Module):
    """``w2(silu(w1(x)) * w3(x))``: gate w1, up w3, down w2 (Shazeer 2020)."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP to ``[b, s, h]``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: ``x + attention(attention_norm(x))``, then ``+ feed_forward(ffn_norm(x))``.

    (The second norm applies to the updated residual stream.)
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden, eps=NORM_EPS)
        self.attention = Attention.of_spec(
            spec, bias=False, dropout=0.0, rope_theta=spec.rope_theta
        )
        self.ffn_norm = RMSNorm(spec.hidden, eps=NORM_EPS)
        # A mixture of experts (``moe``, models/moe.py) in place of the dense ``feed_forward``
        # when the spec has experts (torchtitan's naming).
        self.feed_forward = None if spec.is_moe else SwiGLU(spec.hidden, spec.ffn_hidden)
        self.moe = MoE(
            spec.hidden, spec.expert_hidden, spec.experts, spec.top_k, spec.shared_experts,
            spec.capacity_factor, spec.router_imbalance,
        ) if spec.is_moe else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``[b, s, h]``."""
        x = x + self.attention(self.attention_norm(x))
        ffn = self.moe if self.feed_forward is None else self.feed_forward
        assert ffn is not None  # __init__ sets one of the two
        return x + ffn(self.ffn_norm(x))


def build_llama(spec: ModelSpec) -> Transformer:
    """Build the Llama model of ``spec`` on the current default device."""
    return Transformer(
        spec,
        lambda _: LlamaBlock(spec),
        lambda: RMSNorm(spec.hidden, eps=NORM_EPS),
        learned_positions=False,
    )
