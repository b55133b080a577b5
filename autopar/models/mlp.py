"""A small residual MLP language model (no attention), for quick tests of the planner and runtime.

Structure: ``tok_embeddings``, ``layers.<i>.feed_forward.{w1, w2}`` (Linear-GeLU-Linear with a
residual connection), ``norm`` (LayerNorm), ``output``. Parameters: per block ``2 h f + f + h``;
embedding ``V h``; final LayerNorm ``2h``; untied head ``V h``.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.models.gpt import GPTFeedForward
from autopar.models.norms import LayerNorm
from autopar.models.spec import ModelSpec
from autopar.models.transformer import Transformer

__all__ = ["MLPBlock", "build_mlp"]


class MLPBlock(nn.Module):
    """``x + feed_forward(x)`` with ``feed_forward = w2(gelu(w1(x)))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.feed_forward = GPTFeedForward(spec.hidden, spec.ffn_hidden, spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``[b, s, h]``."""
        return x + self.feed_forward(x)


def build_mlp(spec: ModelSpec) -> Transformer:
    """Build the MLP model of ``spec`` on the current default device."""
    return Transformer(
        spec,
        lambda _: MLPBlock(spec),
        lambda: LayerNorm(spec.hidden),
        learned_positions=False,
    )
