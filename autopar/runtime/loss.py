"""The runtime's loss: the LM default, and the same on logits sharded over the vocabulary.

Under tensor parallelism the head's logits stay a DTensor sharded over the vocabulary
(runtime/tensor_parallel.py) and ``vocab_parallel_loss`` runs under torch's ``loss_parallel()``,
which ``loss_parallel_context`` enters around a step's forward and backward (runtime/step.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from autopar.errors import AutoparError

__all__ = ["default_loss", "loss_parallel_context", "vocab_parallel_loss"]


def default_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """The LM default: the model's own ``output.loss`` when it returns one, else the mean token
    cross entropy of its logits (a tensor output, or ``output.logits``) against ``labels``."""
    from autopar.models.transformer import cross_entropy_loss

    if isinstance(output, torch.Tensor):
        return cross_entropy_loss(output, labels)
    own = getattr(output, "loss", None)
    if isinstance(own, torch.Tensor):
        return own
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if not isinstance(logits, torch.Tensor):
        raise AutoparError(
            f"the model returned {type(output).__name__}, with neither a loss nor logits; "
            "define loss_fn(output, batch) in the model file"
        )
    return cross_entropy_loss(logits, labels)


def vocab_parallel_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """``default_loss`` of logits sharded over the vocabulary (run under ``loss_parallel()``):
    its result, a replicated DTensor, as the plain scalar every tp rank holds (a copy, not a
    view of it: the split-backward pipeline schedules detach their stages' outputs in place)."""
    from torch.distributed.tensor import DTensor

    loss = default_loss(output, labels)
    return loss.to_local().clone() if isinstance(loss, DTensor) else loss


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """torch's ``loss_parallel()`` (the vocab-parallel cross entropy's forward and backward
    rules) when ``enabled``, else a null context."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
