"""Causal self-attention shared by the zoo's gpt and llama blocks.

Heads are viewed as ``-1`` (the local heads) so a tensor-parallel shard of ``wq``/``wk``/``wv``
runs unchanged; grouped-query attention repeats each k/v head ``local_heads // local_kv_heads``
times, computed from the tensor shapes. RoPE (llama) is computed inside forward from the sequence
length, so any contiguous set of blocks runs on its own.

Context parallelism (``autopar.runtime.context_parallel``) sets ``context_parallel`` on the module:
the input is then this rank's share of the sequence, RoPE uses its global positions, and K and V
are all-gathered over the cp ranks, with a causal mask over global positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.spec import ModelSpec

__all__ = ["Attention", "apply_rope"]


def apply_rope(
    x: torch.Tensor, theta: float, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), rotate-half form, on ``x[b, s, heads, d]``.

    Pair i of a head (components i and i + d/2) at position t is rotated by the angle
    ``t * theta^(-2i/d)``.

    Args:
        x: queries or keys, shape (batch, seq, heads, head_dim); head_dim even.
        theta: the RoPE base frequency.
        positions: the tokens' positions ``[seq]`` (default ``0 .. seq - 1``; a context-parallel
            shard passes its global positions).

    Returns:
        The rotated tensor, same shape and dtype as ``x``.
    """
    seq_len, head_dim = x.shape[1], x.shape[-1]
    half = head_dim // 2
    exponent = torch.arange(0, half, device=x.device, dtype=torch.float32) / half
    inv_freq = 1.0 / (theta**exponent)
    if positions is None:
        positions = torch.arange(seq_len, device=x.device, dtype=torch.float32)
    else:
        positions = positions.to(torch.float32)
    angles = torch.outer(positions, inv_freq)  # (s, d/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[None, :, None, :].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention with ``wq, wk, wv, wo``.

    Args:
        hidden: model width h.
        heads: query heads a.
        kv_heads: key/value heads (divides ``heads``).
        bias: whether the four projections have biases (gpt yes, llama no).
        attention: "sdpa" (``F.scaled_dot_product_attention``) or "eager" (s x s scores kept).
        dropout: dropout after softmax and after ``wo``.
        rope_theta: RoPE base frequency, or None for no RoPE (gpt: learned positions).
    """

    def __init__(
        self,
        *,
        hidden: int,
        heads: int,
        kv_heads: int,
        bias: bool,
        attention: str,
        dropout: float,
        rope_theta: float | None,
    ) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.attention = attention
        self.dropout = dropout
        self.rope_theta = rope_theta
        # Fixed at construction (not traced control flow): repeat k/v only under GQA.
        self.grouped = kv_heads != heads
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        # Set by the runtime under context parallelism (a ContextParallel), else None.
        self.context_parallel: Any = None

    @classmethod
    def of_spec(
        cls, spec: ModelSpec, *, bias: bool, dropout: float, rope_theta: float | None
    ) -> Attention:
        """The attention of a block of ``spec`` (width, heads and kernel from the spec)."""
        return cls(
            hidden=spec.hidden, heads=spec.heads, kv_heads=spec.kv_heads, bias=bias,
            attention=spec.attention, dropout=dropout, rope_theta=rope_theta,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x[b, s, h]`` causally; returns ``[b, s, h]``."""
        bsz, seq_len = x.shape[0], x.shape[1]
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        cp = self.context_parallel
        if self.rope_theta is not None:
            positions = None if cp is None else cp.positions(seq_len, x.device)
            q = apply_rope(q, self.rope_theta, positions)
            k = apply_rope(k, self.rope_theta, positions)
        mask = None
        if cp is not None:
            # One all-gather of K and V together over the cp ranks (backward: reduce-scatter).
            k, v = cp.gather(torch.stack([k, v], dim=2)).unbind(2)
            mask = cp.causal_mask(seq_len, x.device)
        if self.grouped:
            repeats = q.shape[2] // k.shape[2]
            k = torch.repeat_interleave(k, repeats, dim=2)
            v = torch.repeat_interleave(v, repeats, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, heads, s, d)
        if self.attention == "sdpa":
            p = self.dropout if self.training else 0.0
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None
            )
        else:
            out = self._eager(q, k, v, mask)
        out = out.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.resid_dropout(self.wo(out))

    def _eager(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        # softmax(q k^T / sqrt(d) + causal mask) v, with the (b, heads, s, s) scores materialised.
        seq_len = q.shape[2]
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        if keep is None:
            keep = q.new_ones((seq_len, seq_len), dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        probs = F.dropout(probs, p=self.dropout, training=self.training)
        return torch.matmul(probs, v)
