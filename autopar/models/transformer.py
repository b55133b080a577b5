"""The zoo's model skeleton: embeddings, a ModuleDict of blocks, final norm, lm head.

Module FQNs follow docs/model-structure.md (torchtitan style): ``tok_embeddings``,
``pos_embeddings`` (gpt), ``layers.<i>``, ``norm``, ``output``. Any of the four outer modules may be
set to None and ``layers`` may hold a subset of its keys (a pipeline stage): forward runs only what
is there. Also the deterministic weight initialisation and the token cross-entropy loss.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.norms import to_autocast_dtype
from autopar.models.spec import ModelSpec

__all__ = ["INIT_STD", "Transformer", "cross_entropy_loss", "init_weights"]

# normal(0, 0.02) for linears and embeddings (GPT-2 / Megatron default init std).
INIT_STD = 0.02


def _embedding(num: int, dim: int) -> nn.Embedding:
    # NOTE: passing the weight skips nn.Embedding's default normal_ init, which on the meta device
    # goes through a decomposition that imports torch._dynamo (over a second on a cold start).
    # init_weights sets the real values on a real device.
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class Transformer(nn.Module):
    """A decoder-only model: ``tokens[b, s] -> logits[b, s, vocab]``.

    Args:
        spec: the model's shape; stored as ``self.autopar_spec``.
        make_block: builds block ``i`` (an ``nn.Module`` mapping ``[b, s, h] -> [b, s, h]``).
        make_norm: builds a norm of width ``hidden`` (the final ``norm``).
        learned_positions: add ``pos_embeddings`` (gpt) after the token embedding.
    """

    def __init__(
        self,
        spec: ModelSpec,
        make_block: Callable[[int], nn.Module],
        make_norm: Callable[[], nn.Module],
        *,
        learned_positions: bool,
    ) -> None:
        super().__init__()
        self.autopar_spec = spec
        self.tok_embeddings: nn.Embedding | None = _embedding(spec.vocab, spec.hidden)
        self.pos_embeddings: nn.Embedding | None = (
            _embedding(spec.seq_len, spec.hidden) if learned_positions else None
        )
        self.layers = nn.ModuleDict({str(i): make_block(i) for i in range(spec.layers)})
        self.norm: nn.Module | None = make_norm()
        self.output: nn.Linear | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Set by the runtime under context parallelism (a ContextParallel): the input is then
        # this rank's share of each sequence and positions are its global ones.
        self.context_parallel: Any = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run the modules present.

        Args:
            tokens: ``LongTensor[b, s]``, or hidden states ``[b, s, hidden]`` when
                ``tok_embeddings`` is None.

        Returns:
            Logits ``[b, s, vocab]``, or hidden states ``[b, s, hidden]`` when ``output`` is None.
        """
        h = tokens
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            cp = self.context_parallel
            if cp is None:
                positions = torch.arange(h.shape[1], device=h.device)
            else:
                positions = cp.positions(h.shape[1], h.device)
            h = h + self.pos_embeddings(positions)
        # Under autocast the residual stream is 16-bit from here on (autopar/models/norms.py).
        h = to_autocast_dtype(h)
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy over ``logits.view(-1, V)`` and ``labels.view(-1)``.

    Args:
        logits: ``[b, s, V]`` (any leading shape).
        labels: token ids, same leading shape.

    Returns:
        A scalar tensor.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _param_seed(seed: int, key: str) -> int:
    # Stable across processes and Python runs (unlike hash()): crc32 of the FQN mixed with the seed.
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)


def _tied_key(model: nn.Module, fqn: str) -> str:
    # A tied lm head is initialised as the token embedding it shares, even in a stage without it.
    spec = getattr(model, "autopar_spec", None)
    if spec is not None and spec.tie_embeddings and fqn == "output.weight":
        return "tok_embeddings.weight"
    return fqn


@torch.no_grad()
def init_weights(model: nn.Module, seed: int | None = None) -> None:
    """Initialise ``model`` in place: normal(0, 0.02) weights, zero biases, unit norm weights.

    With a seed, each parameter is drawn on the CPU from a generator seeded by (seed, FQN), so the
    same seed gives the same weights on every process, whatever subset of modules a process holds
    (a pipeline stage initialises its blocks exactly as the full model would).

    Args:
        model: a zoo model (or part of one) on a real device.
        seed: the seed, or None to draw from torch's global generator.
    """
    for module_fqn, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            is_norm = isinstance(module, (nn.LayerNorm, nn.RMSNorm))
            if name == "bias":
                param.zero_()
            elif is_norm:
                param.fill_(1.0)
            elif seed is None:
                param.normal_(0.0, INIT_STD)
            else:
                gen = torch.Generator(device="cpu").manual_seed(
                    _param_seed(seed, _tied_key(model, fqn))
                )
                values = torch.empty(param.shape, dtype=torch.float32).normal_(
                    0.0, INIT_STD, generator=gen
                )
                param.copy_(values)
