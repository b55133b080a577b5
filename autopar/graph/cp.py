"""Whether autopar's runtime can shard a traced model's sequences over cp ranks.

autopar's runtime runs context parallelism inside the attention it runs (the all-gather-KV
variant: ``runtime/context_parallel.py``): the zoo's own attention, and the attention of a
Hugging Face decoder that calls transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``,
which the runtime points at its own function) with rotary positions (a ``rotary_emb`` module,
whose position ids the runtime replaces by the global positions of the rank's chunks) over the
causal context, or within the layer's sliding window (Mistral, Gemma 3). Attention with sinks
(gpt-oss) or capped logits (Gemma 2) runs its family's own eager attention function on the
gathered keys and values (``family_eager``). ``cp_blocker`` says why not otherwise: learned
absolute positions, chunked attention, layers that are not attention, sinks or capped logits
without a family eager function, attention that does not call the interface, or a model file's
own attention.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

from torch import nn

__all__ = ["cp_blocker", "family_eager"]


def family_eager(cls: type[nn.Module]) -> Callable | None:
    """The ``eager_attention_forward`` of the transformers module defining attention class
    ``cls`` (the function its forward falls back to), or None."""
    module = sys.modules.get(cls.__module__)
    found = getattr(module, "eager_attention_forward", None)
    return found if callable(found) else None


def cp_blocker(model: nn.Module) -> str:
    """Why autopar's runtime cannot shard ``model``'s sequences over cp ("" when it can)."""
    from autopar.models.transformer import Transformer

    if isinstance(model, Transformer):
        return ""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return f"{name}'s attention is its own code, not autopar's zoo or transformers' interface"
    if not any(n.rpartition(".")[2] == "rotary_emb" for n, _ in model.named_modules()):
        return f"{name} has no rotary embeddings (its positions are learned, or none)"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if getattr(config, "attention_chunk_size", None):
        return f"{name} attends within chunks of the sequence"
    if layer_types - {"full_attention", "sliding_attention"}:
        return f"{name} has layers other than attention ({sorted(layer_types)})"
    attentions = {type(m) for n, m in model.named_modules()
                  if type(m).__name__.endswith("Attention")}
    if not attentions or not all(_calls_interface(c) for c in attentions):
        return f"{name}'s attention does not call transformers' attention interface"
    sinks = [n for n, _ in model.named_parameters() if n.rpartition(".")[2] == "sinks"]
    special = (f"attention sinks ({sinks[0]})" if sinks else "capped attention logits"
               if getattr(config, "attn_logit_softcapping", None) else "")
    if special and not all(family_eager(c) for c in attentions):
        return f"{name}'s attention keeps {special} and its family has no eager attention function"
    return ""


def _calls_interface(cls: type[nn.Module]) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
