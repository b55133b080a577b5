"""Seeded synthetic token data for ``autopar run``.

The batch of step ``k`` depends only on ``(seed, k)`` and the batch shape, never on the split or on
how many steps ran before, so a run resumed from a checkpoint sees exactly the data an
uninterrupted run would have seen, and every split sees the same global batch
(``autopar.runtime.step.local_batch`` gives each data-parallel rank its rows).

Each sequence is an arithmetic progression modulo the vocabulary, ``x[t] = (start + stride * t)
mod V`` with a random start and a random stride in ``[1, MAX_STRIDE]``: a model can learn it from
context, so the loss visibly falls over a few steps (uniform random tokens would keep it at
``ln V``). Labels are the inputs shifted by one position (next-token prediction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MAX_STRIDE", "TokenBatch", "step_seed", "synthetic_batch"]

# Largest stride of the synthetic progressions; small, so the task is learnable by a tiny model.
MAX_STRIDE = 8
# Multiplier that mixes the step into the generator seed (a large prime keeps (seed, step) pairs
# from colliding for any realistic number of steps).
_STEP_MIX = 1_000_003


def step_seed(seed: int, step: int) -> int:
    """The generator seed of step ``step`` of a run seeded ``seed`` (its data; the CLI bounds
    ``seed`` so this stays within torch's signed 64-bit seeds: cli/argtypes.MAX_SEED)."""
    return seed * _STEP_MIX + step


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenBatch:
    """One global batch of next-token-prediction data.

    Attributes:
        tokens: LongTensor[batch, seq_len], the model inputs.
        labels: LongTensor[batch, seq_len], ``tokens`` shifted left by one position.
    """

    tokens: torch.Tensor
    labels: torch.Tensor


def synthetic_batch(*, seed: int, step: int, batch: int, seq_len: int, vocab: int) -> TokenBatch:
    """The global batch of step ``step`` (1-based), a pure function of its arguments.

    Args:
        seed: the run's seed (``--seed``).
        step: the optimizer step the batch is for, counted from 1.
        batch: sequences in the global batch.
        seq_len: tokens per sequence.
        vocab: vocabulary size V (token ids are in ``[0, V)``).

    Returns:
        The batch on the CPU (callers move it to their device).
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(step_seed(seed, step))
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, MAX_STRIDE + 1, (batch, 1), generator=gen)
    positions = torch.arange(seq_len + 1).unsqueeze(0)
    seq = (start + stride * positions) % vocab
    return TokenBatch(tokens=seq[:, :-1].contiguous(), labels=seq[:, 1:].contiguous())
