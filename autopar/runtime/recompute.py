"""Activation recomputation per block, as the plan chose it (torch.utils.checkpoint).

* ``full``: the whole block runs under ``torch.utils.checkpoint.checkpoint`` (non-reentrant): only
  the block's input is kept, everything inside (including its tensor-parallel collectives) is
  recomputed in backward.
* ``selective``: the block's attention module runs under selective activation checkpointing
  (``create_selective_checkpoint_contexts``): the outputs of matrix multiplications (the q/k/v and
  output projections) and of collectives are saved, everything else in the attention (RoPE, head
  reshapes, the SDPA / softmax core) is recomputed. No collective is re-run.

The block's ``forward`` is replaced on the instance (not wrapped in another module), so parameter
FQNs stay those of the full model and module hooks (tensor/data parallel) stay outside the
checkpoint. Only blocks are recomputed; the embedding and head layers keep their activations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from autopar.errors import AutoparError

__all__ = ["ATTENTION_NAMES", "apply_recompute", "find_attention"]

# Child names recognised as a block's attention module (zoo, HF Llama / GPT-2 style models,
# BLOOM and Falcon).
ATTENTION_NAMES: tuple[str, ...] = ("attention", "self_attn", "attn", "self_attention")
# Ops whose outputs selective recomputation keeps (matmuls); collectives are always kept.
_SAVED_OPS = frozenset(
    {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default}
)
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d"})


def find_attention(block: nn.Module) -> nn.Module | None:
    """The attention child of a block, or None."""
    for name in ATTENTION_NAMES:
        child = getattr(block, name, None)
        if isinstance(child, nn.Module):
            return child
    return None


def _selective_policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _SAVED_OPS or getattr(op, "namespace", "") in _COLLECTIVE_NAMESPACES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed(forward: Callable[..., Any], selective: bool, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    if selective:
        return checkpoint(
            forward, *args, use_reentrant=False, context_fn=_selective_context, **kwargs
        )
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _wrap_forward(module: nn.Module, selective: bool) -> None:
    # NOTE: an instance attribute shadows the class's forward; nn.Module.__call__ still runs the
    # module's hooks around it, so hooks are not recomputed and FQNs do not change.
    module.forward = functools.partial(_checkpointed, module.forward, selective)


def apply_recompute(blocks: Mapping[str, nn.Module], recompute: Mapping[str, str]) -> None:
    """Apply each block's recomputation choice in place.

    Args:
        blocks: block FQN (e.g. "layers.3") -> block module, for the blocks this rank owns.
        recompute: block FQN -> "none" | "selective" | "full" (missing means "none").

    Raises:
        AutoparError: "selective" for a block without a recognised attention child.
    """
    for fqn, block in blocks.items():
        mode = recompute.get(fqn, "none")
        if mode == "full":
            _wrap_forward(block, selective=False)
        elif mode == "selective":
            attention = find_attention(block)
            if attention is None:
                raise AutoparError(
                    f"selective recomputation of {fqn} needs an attention child named one of "
                    f"{ATTENTION_NAMES}; use recompute 'full' or 'none' for this model"
                )
            _wrap_forward(attention, selective=True)
