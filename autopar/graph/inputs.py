"""Example inputs at a given batch size, on the meta device, and the loss the profile runs.

Zoo and HF models get token ids ``[b, s]``; a model file's ``example_inputs(batch_size)`` (or a
batch given directly, re-sized along dim 0) is moved to the meta device, its floating-point
tensors at the profile dtype: training at bf16 feeds the model bf16 inputs (FSDP2's
``MixedPrecisionPolicy`` casts forward inputs to ``param_dtype``; autocast casts them at the first
matmul or convolution), so an fp32 image batch is saved for backward at bf16, not fp32.

The loss is the model file's ``loss_fn`` when there is one; otherwise logits get the token cross
entropy with the logits upcast to fp32 (what the zoo and HF losses do), and any other output a
plain fp32 sum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from autopar.errors import ModelFileError
from autopar.models.losses import fused_cross_entropy

__all__ = ["Batch", "checked_loss", "compute_loss", "logit_positions_short", "make_batch",
           "own_batches", "pipeline_blocker", "seq_len_of"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """Inputs of one profiling run.

    Attributes:
        args: positional inputs of ``model(...)``.
        kwargs: keyword inputs (HF models: ``use_cache=False``).
        raw: the batch as the user's ``example_inputs`` returned it (passed to ``loss_fn``).
        labels: token ids for the default loss, or None.
    """

    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    raw: Any = None
    labels: torch.Tensor | None = None


def _to_meta(value: Any, dtype: torch.dtype | None = None) -> Any:
    """Tensors of ``value`` on the meta device; floating-point ones at ``dtype`` if given."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return t.to(device="meta", dtype=cast)

    return tree_map(one, value)


def _resize(value: Any, batch_size: int) -> Any:
    # Re-size every tensor that shares the first tensor's leading (batch) dimension.
    leaves = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not leaves:
        return value
    batch = leaves[0].shape[0]

    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
            return t[:1].expand(batch_size, *t.shape[1:]).clone()
        return t

    return tree_map(one, value)


def _as_call(raw: Any) -> tuple[tuple, dict[str, Any]]:
    if isinstance(raw, Mapping):
        return (), dict(raw)
    if isinstance(raw, (tuple, list)):
        return tuple(raw), {}
    return (raw,), {}


def make_batch(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    example_inputs: Any,
    dtype: torch.dtype | None = None,
) -> Batch:
    """Build the meta-device inputs of one run.

    Args:
        model: the model (an HF model gets ``use_cache=False``).
        batch_size: sequences in the batch.
        seq_len: tokens per sequence (used when ``example_inputs`` is None).
        example_inputs: None (token ids), ``example_inputs(batch_size)`` callable, or a batch.
        dtype: the training dtype the model's floating-point inputs are cast to (None: as
            given); ``raw``, which ``loss_fn`` reads, keeps the batch's own dtypes.

    Returns:
        The Batch.
    """
    hf_kwargs = {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}
    if example_inputs is None:
        tokens = torch.zeros((batch_size, seq_len), dtype=torch.long, device="meta")
        targets = torch.zeros((batch_size, seq_len), dtype=torch.long, device="meta")
        return Batch(args=(tokens,), kwargs=hf_kwargs, raw=tokens, labels=targets)
    given = example_inputs(batch_size) if callable(example_inputs) else example_inputs
    raw = _to_meta(given)
    if not callable(example_inputs):
        raw = _resize(raw, batch_size)
    args, kwargs = _as_call(_to_meta(raw, dtype))
    first = next((t for t in tree_flatten(raw)[0] if isinstance(t, torch.Tensor)), None)
    labels: torch.Tensor | None = None
    if first is not None and first.dim() == 2 and not first.is_floating_point():
        labels = torch.zeros_like(first)  # the targets: a tensor of their own, like the tokens
    return Batch(args=args, kwargs={**hf_kwargs, **kwargs}, raw=raw, labels=labels)


def own_batches(example_inputs: Any, loss_fn: Callable[..., Any] | None) -> bool:
    """Whether the model trains on its own ``example_inputs`` batches rather than token ids: it
    has a ``loss_fn``, or its inputs are not one 2-D integer tensor."""
    if loss_fn is not None:
        return True
    if example_inputs is None:
        return False
    sample = example_inputs(1) if callable(example_inputs) else example_inputs
    return not (isinstance(sample, torch.Tensor) and sample.dim() == 2
                and not sample.is_floating_point())


def pipeline_blocker(example_inputs: Any, loss_fn: Callable[..., Any] | None) -> str:
    """Why autopar's runtime cannot pipeline a model trained on these inputs ("" when it can):
    its pipeline schedule splits token ids into micro-batches (``own_batches``)."""
    if not own_batches(example_inputs, loss_fn):
        return ""
    return ("it trains on its own example_inputs batches (for a loss_fn, or inputs that are not "
            "token ids), and pipeline stages take token ids (to pipeline it, make "
            "example_inputs(batch_size) return the token ids alone and drop loss_fn)")


def seq_len_of(example_inputs: Any) -> int | None:
    """Tokens per sequence of a batch: dim 1 of its first tensor (None if it has none)."""
    raw = example_inputs(1) if callable(example_inputs) else example_inputs
    for leaf in tree_flatten(raw)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2:
            return int(leaf.shape[1])
    return None


def _logits(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    return leaves[0] if leaves else None


def logit_positions_short(output: Any, batch: Batch, vocab: int) -> int | None:
    """1 when the output's logits cover one position of several input tokens, else None.

    A nanoGPT-style ``forward(idx, targets=None)`` returns the logits of the last position only
    when it is given no targets (generation), so a profile of that call misses the head's and
    the loss's work on every other position. (Other lengths are left alone: a decoder's logits
    may rightly cover fewer positions than the encoder's tokens.)
    """
    if batch.labels is None or batch.labels.dim() != 2 or vocab <= 0:
        return None
    logits = _logits(output)
    if logits is None or logits.dim() != 3 or logits.shape[-1] != vocab:
        return None
    positions, tokens = int(logits.shape[1]), int(batch.labels.shape[1])
    return positions if positions == 1 < tokens else None


def checked_loss(value: Any) -> torch.Tensor:
    """A ``loss_fn``'s result, which must be one number (ModelFileError otherwise)."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shown = (f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
                 else f"a {type(value).__name__}")
        raise ModelFileError(f"loss_fn returned {shown}, not a scalar tensor; return the "
                             "batch's loss as one number (a 0-dim tensor)")
    return value


def compute_loss(
    output: Any, batch: Batch, vocab: int, loss_fn: Callable[..., Any] | None,
    loss: str = "eager",
) -> torch.Tensor:
    """The scalar the profile runs backward from.

    Args:
        output: what the model returned.
        batch: the run's inputs.
        vocab: vocabulary size (0 if unknown): a ``[b, s, vocab]`` output is taken as logits.
        loss_fn: the model file's ``loss_fn(output, batch)``, or None.
        loss: the token cross entropy's kernel without ``loss_fn``: "eager" (torch's, on fp32
            logits) or "fused" (``autopar.models.losses.fused_cross_entropy``).

    Returns:
        A scalar tensor.
    """
    if loss_fn is not None:
        return checked_loss(loss_fn(output, batch.raw))
    logits = _logits(output)
    if logits is None:
        raise ValueError("the model returned no tensor to run backward from")
    looks_like_logits = vocab > 0 and logits.dim() == 3 and logits.shape[-1] == vocab
    if looks_like_logits and batch.labels is not None and batch.labels.shape == logits.shape[:2]:
        # Token cross entropy with fp32 logits (the zoo's and HF's loss): log_softmax keeps the
        # fp32 log-probabilities (4 s V bytes a sample) for backward.
        if loss == "fused":
            return fused_cross_entropy(logits, batch.labels)
        flat = logits.reshape(-1, vocab).float()
        return F.cross_entropy(flat, batch.labels.reshape(-1))
    return logits.float().sum()
