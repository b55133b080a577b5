"""GPT-2 / GPT-3 style model: learned positions, pre-LayerNorm blocks, GeLU MLP, biases.

Parameters (Megatron-LM SC'21 eq. 2 with ffn_hidden = 4h, plus the final LayerNorm):
per block ``12 h^2 + 13 h`` (qkv ``3h^2 + 3h``, wo ``h^2 + h``, MLP ``8h^2 + 5h``, two LayerNorms
``4h``); embeddings ``(V + s) h``; final LayerNorm ``2h``; an untied head adds ``V h``.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.models.attention import Attention
from autopar.models.norms import LayerNorm
from autopar.models.spec import ModelSpec
from autopar.models.transformer import Transformer

__all__ = ["GPTBlock", "GPTFeedForward", "build_gpt"]


class GPTFeedForward(nn.Module):
    """``w2(dropout?)(gelu(w1(x)))``: fc to ``ffn_hidden``, GeLU, projection back to ``hidden``."""

    def __init__(self, hidden: int, ffn_hidden: int, dropout: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn_hidden)
        self.w2 = nn.Linear(ffn_hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``[b, s, h]``."""
        return self.dropout(self.w2(nn.functional.gelu(self.w1(x))))


class GPTBlock(nn.Module):
    """Pre-norm block: ``x + attention(attention_norm(x))``, then ``+ feed_forward(ffn_norm(x))``.

    (The second norm applies to the updated residual stream.)
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attention_norm = LayerNorm(spec.hidden)
        self.attention = Attention.of_spec(spec, bias=True, dropout=spec.dropout, rope_theta=None)
        self.ffn_norm = LayerNorm(spec.hidden)
        self.feed_forward = GPTFeedForward(spec.hidden, spec.ffn_hidden, spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``[b, s, h]``."""
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


def build_gpt(spec: ModelSpec) -> Transformer:
    """Build the GPT model of ``spec`` on the current default device."""
    return Transformer(
        spec,
        lambda _: GPTBlock(spec),
        lambda: LayerNorm(spec.hidden),
        learned_positions=True,
    )
