"""Token cross entropy as a fused kernel computes it: saves the logits (their own dtype) and one
fp32 log-sum-exp per token, and returns the gradient as one tensor of the logits' dtype.

flash-attn's ``CrossEntropyLoss`` (``flash_attn.losses.cross_entropy``), which llm-foundry
trains with by default (``ComposerMPTCausalLM``: ``loss_fn`` defaults to
"fused_crossentropy"), keeps exactly that; torch's ``F.cross_entropy`` on fp32 logits instead
keeps the fp32 log-probabilities (4 s V bytes a sample) and allocates two fp32 gradients in its
backward. ``autopar.profile(model,
loss="fused")`` profiles with this function, so the head's saved bytes are the fused kernel's.
The forward and backward run in row chunks (``CHUNK_ROWS``) so no fp32 copy of the whole logits
is ever live; the result equals ``F.cross_entropy`` (tests/unit/test_fused_loss.py).
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.config import LOSS_KERNELS

__all__ = ["CHUNK_ROWS", "LOSS_KERNELS", "fused_cross_entropy"]

CHUNK_ROWS = 4096  # rows of [N, V] in fp32 at a time


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], CHUNK_ROWS):
            lse[start:start + CHUNK_ROWS] = torch.logsumexp(
                logits[start:start + CHUNK_ROWS].float(), dim=-1)
        picked = logits.gather(1, labels.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, lse, labels)
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, lse, labels = ctx.saved_tensors
        scale = grad / logits.shape[0]
        out = torch.empty_like(logits)
        for start in range(0, logits.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            probs = torch.exp(logits[rows].float() - lse[rows].unsqueeze(1))
            probs.scatter_add_(1, labels[rows].unsqueeze(1),
                               -torch.ones_like(lse[rows]).unsqueeze(1))
            out[rows] = (probs * scale).to(out.dtype)
        return out, None


def fused_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy of ``logits [..., V]`` against ``labels [...]``, fused (module
    docstring)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _FusedCrossEntropy.apply(flat, labels.reshape(-1))
