"""Whether an attention module with a fused q/k/v projection runs on one tensor-parallel rank's
share of it: the rule the profiler records (``TPStructure.split_blocker``, so the planner never
proposes such a split for autopar's runtime) and the runtime checks before it splits a model
(``runtime/tp_checks.py``).

A rank holds 1/tp of the fused projection's output (its heads of q, k and v) and of the output
projection's input; the attention then splits its fused output by a width attribute (GPT-2
``split_size``, nanoGPT ``n_embd``) and counts heads by another (``n_head``, ``num_heads``), which
``localize_fused_attention`` divides by tp. An attention that sizes its views by its input's width
instead, or whose forward needs more than the hidden states, does not run so.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FUSED_HEAD_ATTRS", "FUSED_WIDTH_ATTRS", "is_conv1d", "local_attention_error",
           "localize_fused_attention"]

# Attributes an attention module splits its fused q/k/v output by (GPT-2, nanoGPT), and counts its
# heads by; a rank runs 1/tp of both.
FUSED_WIDTH_ATTRS: tuple[str, ...] = ("split_size", "n_embd")
FUSED_HEAD_ATTRS: tuple[str, ...] = ("n_head", "num_heads")


def is_conv1d(module: nn.Module) -> bool:
    """Whether a linear is Hugging Face's ``Conv1D`` (weight ``[in, out]``), not ``nn.Linear``."""
    return not isinstance(module, nn.Linear)


def localize_fused_attention(attention: nn.Module, tp: int) -> None:
    """Give an attention module with a fused q/k/v projection its per-rank widths and heads."""
    for name in (*FUSED_WIDTH_ATTRS, *FUSED_HEAD_ATTRS):
        value = getattr(attention, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(attention, name, value // tp)


def _local_shape(module: nn.Module, name: str, shape: torch.Size, style: str, tp: int) -> list[int]:
    # The per-rank shape of a parameter of a linear split ``style`` ("colwise" or "rowwise").
    local = list(shape)
    conv = is_conv1d(module)
    if name == "bias":
        dim = 0 if style != "rowwise" else None
    elif style == "rowwise":
        dim = 0 if conv else 1
    else:
        dim = 1 if conv else 0
    if dim is not None:
        local[dim] //= tp
    return local


def local_attention_error(
    attention: nn.Module, styles: dict[str, str], tp: int, seq_len: int = 2
) -> str | None:
    """Run ``attention`` on the meta device with one rank's shapes; the error, or None if it runs.

    Args:
        attention: the module holding a fused q/k/v projection (not yet parallelized).
        styles: its linears' styles by FQN relative to it ("c_attn": "colwise_qkv", ...).
        tp: the tensor-parallel degree.
        seq_len: tokens of the trial input.

    Returns:
        A one-line reason the forward fails or returns the wrong shape on the local shapes.
    """
    tensors: dict[str, torch.Tensor] = {}
    for fqn, tensor in (*attention.named_parameters(), *attention.named_buffers()):
        owner, _, name = fqn.rpartition(".")
        style = styles.get(owner)
        shape = tensor.shape
        if style is not None:
            module = attention.get_submodule(owner)
            shape = torch.Size(_local_shape(module, name, shape, style.replace("_qkv", ""), tp))
        tensors[fqn] = torch.empty(shape, dtype=tensor.dtype, device="meta")
    fused = attention.get_submodule(next(f for f, s in styles.items() if s == "colwise_qkv"))
    hidden = fused.weight.shape[0 if is_conv1d(fused) else 1]
    saved = {name: getattr(attention, name) for name in (*FUSED_WIDTH_ATTRS, *FUSED_HEAD_ATTRS)
             if hasattr(attention, name)}
    widths = {f: attention.get_submodule(f).nf for f, s in styles.items()
              if s != "rowwise" and hasattr(attention.get_submodule(f), "nf")}
    try:
        localize_fused_attention(attention, tp)
        for f, nf in widths.items():
            attention.get_submodule(f).nf = nf // tp
        x = torch.zeros(1, seq_len, hidden, device="meta")
        with torch.no_grad():
            out = torch.func.functional_call(attention, tensors, (x,))
    except Exception as err:  # the model's own code: any failure is the answer
        return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
    finally:
        for name, value in saved.items():
            setattr(attention, name, value)
        for f, nf in widths.items():
            attention.get_submodule(f).nf = nf
    out = out if isinstance(out, torch.Tensor) else out[0]
    if tuple(out.shape) != (1, seq_len, hidden):
        return f"it returns shape {tuple(out.shape)} for an input of {(1, seq_len, hidden)}"
    return None
