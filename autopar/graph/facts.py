"""The model-wide numbers of a profile (hidden, heads, vocab, ...), from wherever they are known.

In order: a zoo model's ``autopar_spec``; an HF model's ``config``; otherwise inferred from the
modules and what the profiling run observed (the blocks' input width, the largest embedding, the
heads seen by SDPA).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ModelFacts", "default_seq_len", "model_facts"]

# Sequence length profiled for an HF model when none is given: its context, capped (documented).
HF_DEFAULT_SEQ_CAP = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFacts:
    """Model-wide sizes (0 where a model has none, e.g. heads of an MLP)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    attention: str


def _first(obj: Any, *names: str) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def default_seq_len(model: nn.Module) -> int | None:
    """The sequence length to profile when the caller gives none (zoo spec, HF context)."""
    spec = getattr(model, "autopar_spec", None)
    if spec is not None:
        return int(spec.seq_len)
    config = getattr(model, "config", None)
    context = _first(config, "max_position_embeddings", "n_positions", "n_ctx")
    return min(int(context), HF_DEFAULT_SEQ_CAP) if context else None


# Learned absolute position embeddings, by the module names of the zoo GPT (pos_embeddings),
# GPT-2 (wpe), OPT (embed_positions) and BERT-like families (position_embeddings): a sequence
# longer than their rows indexes past them (on meta nothing checks; on a device it fails).
_POSITION_TABLES = re.compile(r"(^|\.)(wpe|pos_embeddings|embed_positions|position_embeddings)$")


def learned_positions(model: nn.Module) -> tuple[str, int] | None:
    """(module name, rows) of the model's learned position embedding, None when it has none
    (rotary or ALiBi positions bound no sequence length)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and _POSITION_TABLES.search(name):
            return name, int(module.num_embeddings)
    return None


def _largest_embedding(model: nn.Module) -> int:
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(sizes, default=0)


def _ffn_width(block: nn.Module | None, hidden: int) -> int:
    if block is None:
        return 0
    widths = [
        m.out_features
        for m in block.modules()
        if isinstance(m, nn.Linear) and m.in_features == hidden and m.out_features != hidden
    ]
    return max(widths, default=0)


def model_facts(
    model: nn.Module,
    *,
    hidden_seen: int,
    heads_seen: int,
    kv_heads_seen: int,
    block: nn.Module | None,
) -> ModelFacts:
    """The model's sizes.

    Args:
        model: the model.
        hidden_seen: last dimension of the first block's input (0 if no blocks).
        heads_seen: query heads SDPA saw in a block (0 if SDPA was not called).
        kv_heads_seen: key/value heads SDPA saw.
        block: a block module (to infer the MLP width), or None.

    Returns:
        The ModelFacts.
    """
    attention = "sdpa" if heads_seen else "eager"
    spec = getattr(model, "autopar_spec", None)
    if spec is not None:
        return ModelFacts(
            name=spec.name or spec.kind,
            hidden=spec.hidden,
            heads=spec.heads,
            kv_heads=spec.kv_heads,
            ffn_hidden=spec.ffn_hidden,
            vocab=spec.vocab,
            attention=spec.attention if spec.heads else "sdpa",
        )
    config = getattr(model, "config", None)
    hidden = int(_first(config, "hidden_size", "n_embd", "d_model") or hidden_seen)
    heads = int(_first(config, "num_attention_heads", "n_head") or heads_seen)
    kv_heads = int(_first(config, "num_key_value_heads") or kv_heads_seen or heads)
    ffn = _first(config, "intermediate_size", "n_inner", "ffn_dim")
    if ffn is None and config is not None and _first(config, "n_embd") is not None:
        ffn = 4 * hidden  # GPT-2: n_inner None means 4 * n_embd
    return ModelFacts(
        name=str(_first(config, "model_type") or type(model).__name__),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn_hidden=int(ffn or _ffn_width(block, hidden)),
        vocab=int(_first(config, "vocab_size") or _largest_embedding(model)),
        attention=attention if heads else "sdpa",
    )
