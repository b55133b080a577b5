"""Build zoo models by kind (gpt, llama, mlp) or preset name, on the meta device by default.

``make_spec`` turns keyword sizes into a validated ModelSpec (with each kind's defaults),
``build`` constructs the model, and ``num_params`` is the closed-form parameter count the
profiler and the docs quote (a test checks it against the built model).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from autopar.config import TORCH_DTYPE_NAMES
from autopar.errors import UnknownModelError
from autopar.models.gpt import build_gpt
from autopar.models.llama import build_llama
from autopar.models.mlp import build_mlp
from autopar.models.presets import PRESETS, preset_shape
from autopar.models.spec import KINDS, ModelSpec, llama_default_ffn_hidden
from autopar.models.transformer import Transformer, init_weights

__all__ = ["SHAPE_KEYS", "TORCH_DTYPES", "build", "list_presets", "make_spec", "num_params",
           "suggest_names", "torch_dtype"]

# autopar's dtype names -> the torch dtypes it builds, profiles and trains models in.
TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {name: getattr(torch, torch_name) for name, torch_name in TORCH_DTYPE_NAMES.items()})

_BUILDERS: dict[str, Callable[[ModelSpec], Transformer]] = {
    "gpt": build_gpt,
    "llama": build_llama,
    "mlp": build_mlp,
}
_REQUIRED = {
    "gpt": ("layers", "hidden", "heads", "vocab", "seq_len"),
    "llama": ("layers", "hidden", "heads", "vocab", "seq_len"),
    "mlp": ("layers", "hidden", "vocab", "seq_len"),
}
_OPTIONAL = {
    "gpt": ("ffn_hidden", "kv_heads", "attention", "dropout", "tie_embeddings"),
    "llama": ("ffn_hidden", "kv_heads", "attention", "tie_embeddings", "rope_theta", "experts",
              "top_k", "shared_experts", "expert_hidden", "capacity_factor",
              "router_imbalance"),
    "mlp": ("ffn_hidden", "tie_embeddings"),
}
# Every keyword a kind accepts, by kind.
SHAPE_KEYS = {kind: _REQUIRED[kind] + _OPTIONAL[kind] for kind in KINDS}


def suggest_names(name: str) -> str:
    """A ' Did you mean ...?' hint listing the kinds and presets closest to ``name`` (or '')."""
    close = difflib.get_close_matches(name.lower(), [*KINDS, *PRESETS], n=3, cutoff=0.5)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _unknown(name: str) -> UnknownModelError:
    return UnknownModelError(
        f"unknown model {name!r}.{suggest_names(name)} Kinds: {', '.join(KINDS)}; "
        f"presets: autopar.models.list_presets()"
    )


def make_spec(kind_or_preset: str, **shape: Any) -> ModelSpec:
    """Validate sizes for a kind (or a preset with overrides) and fill in the kind's defaults.

    Args:
        kind_or_preset: "gpt", "llama", "mlp", or a preset name such as "gpt3-175b".
        **shape: sizes (``layers, hidden, heads, vocab, seq_len``, and ``ffn_hidden``,
            ``kv_heads``, ``attention``, ``dropout``, ``tie_embeddings``, ``rope_theta`` where the
            kind has them); for a preset, any of these overrides the preset's value.

    Returns:
        The ModelSpec.

    Raises:
        UnknownModelError: the name is neither a kind nor a preset.
        ValueError: a missing, unknown or impossible size.
    """
    name = kind_or_preset
    if not isinstance(name, str):
        raise TypeError(f"the model must be named by a string (a kind or a preset), got "
                        f"{type(name).__name__}")
    if name in PRESETS:
        merged = preset_shape(name)
        kind = merged.pop("kind")
        merged.update(shape)
        shape = merged
    elif name in KINDS:
        kind = name
    else:
        raise _unknown(name)
    unknown = sorted(set(shape) - set(SHAPE_KEYS[kind]))
    if unknown:
        raise ValueError(
            f"{name!r} does not take {', '.join(unknown)}; it takes {', '.join(SHAPE_KEYS[kind])}"
        )
    missing = [key for key in _REQUIRED[kind] if shape.get(key) is None]
    if missing:
        raise ValueError(
            f"{name!r} needs {', '.join(missing)} (e.g. build({kind!r}, layers=4, ...))"
        )
    return ModelSpec(kind=kind, name=name, **_with_defaults(kind, shape))


def _with_defaults(kind: str, shape: dict[str, Any]) -> dict[str, Any]:
    out = dict(shape)
    hidden = out["hidden"]
    if out.get("ffn_hidden") is None:
        # An impossible hidden is left for ModelSpec to name (it checks hidden first).
        valid = isinstance(hidden, int) and not isinstance(hidden, bool) and hidden > 0
        out["ffn_hidden"] = (hidden if not valid else llama_default_ffn_hidden(hidden)
                             if kind == "llama" else 4 * hidden)
    if out.get("experts") and not out.get("expert_hidden"):
        out["expert_hidden"] = out["ffn_hidden"]
    if kind == "mlp":
        out["heads"] = out["kv_heads"] = 0
    elif out.get("kv_heads") is None:
        out["kv_heads"] = out["heads"]
    return out


def build(
    kind_or_preset: str,
    *,
    device: str | torch.device = "meta",
    dtype: torch.dtype | str = torch.float32,
    seed: int | None = None,
    **shape: Any,
) -> nn.Module:
    """Build a zoo model.

    Args:
        kind_or_preset: "gpt", "llama", "mlp", or a preset name (see ``list_presets()``).
        device: where the weights live; "meta" (default) allocates nothing.
        dtype: parameter dtype (a torch dtype, or "bf16", "fp16", "fp32").
        seed: on a real device, initialise the weights deterministically from this seed
            (normal(0, 0.02) linears and embeddings, zero biases, unit norms); None draws from
            torch's global generator. Ignored on meta.
        **shape: sizes; see ``make_spec``.

    Returns:
        The model (a ``Transformer``), with ``model.autopar_spec`` set.

    Raises:
        UnknownModelError: unknown kind or preset (with close-name suggestions).
        ValueError: missing, unknown or impossible sizes.

    Example:
        >>> model = build("gpt", layers=2, hidden=64, heads=4, vocab=256, seq_len=32)
        >>> model = build("gpt3-175b", seq_len=4096)
    """
    spec = make_spec(kind_or_preset, **shape)
    dtype = torch_dtype(dtype)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device; use 'meta' (the default), "
                         "'cpu' or 'cuda'") from None
    with device:
        model = _BUILDERS[spec.kind](spec)
    if device.type != "meta":
        init_weights(model, seed)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model


def torch_dtype(dtype: Any) -> torch.dtype:
    """A training dtype autopar builds and profiles models in: ``torch.bfloat16``,
    ``float16`` or ``float32``, or autopar's name of one ("bf16", "fp16", "fp32").

    Raises:
        ValueError: any other value.
    """
    if isinstance(dtype, str) and dtype in TORCH_DTYPES:
        return TORCH_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in TORCH_DTYPES.values():
        return dtype
    raise ValueError(f"dtype {dtype!r} is not one autopar trains in; pass torch.bfloat16, "
                     f"float16 or float32, or a name among {', '.join(TORCH_DTYPE_NAMES)}")


def num_params(spec: ModelSpec) -> int:
    """Closed-form parameter count of the model ``spec`` describes (tied weights counted once).

    gpt (Megatron-LM SC'21 eq. 2 generalised to any ffn width f and k = kv_heads * head_dim
    key/value width, plus the final LayerNorm):
    ``l (2h^2 + 2hk + 2h + 2k + 2hf + f + h + 4h) + (V + s) h + 2h`` (+ ``V h`` untied; k = h
    without grouped-query attention: ``4h^2 + 4h`` for the attention).
    llama: ``l (2h^2 + 2h k + 3h f + 2h) + V h + h`` (+ ``V h`` untied), with k = kv_heads *
    head_dim; with E experts of width f_e (s_e shared) the ``3 h f`` becomes
    ``E h + 3 h f_e (E + s_e)`` (router, routed and shared experts).
    mlp: ``l (2hf + f + h) + V h + 2h`` (+ ``V h`` untied).
    """
    h, f, v, n = spec.hidden, spec.ffn_hidden, spec.vocab, spec.layers
    head = 0 if spec.tie_embeddings else v * h
    kv = spec.kv_heads * spec.head_dim  # key/value width
    if spec.kind == "gpt":
        block = 2 * h * h + 2 * h * kv + 2 * h + 2 * kv + 2 * h * f + f + h + 4 * h
        return n * block + (v + spec.seq_len) * h + 2 * h + head
    if spec.kind == "llama":
        ffn = 3 * h * f
        if spec.experts:
            ffn = spec.experts * h + 3 * h * spec.expert_hidden * (
                spec.experts + spec.shared_experts)
        block = 2 * h * h + 2 * h * kv + ffn + 2 * h
        return n * block + v * h + h + head
    return n * (2 * h * f + f + h) + v * h + 2 * h + head


def list_presets() -> dict[str, str]:
    """Preset name -> one-line description with its shape, parameter count and source."""
    out = {}
    for name, (_, source) in PRESETS.items():
        spec = make_spec(name)
        kv = f", {spec.kv_heads} kv heads" if spec.kv_heads != spec.heads else ""
        if spec.experts:
            shared = f" + {spec.shared_experts} shared" if spec.shared_experts else ""
            kv += (f", {spec.experts} experts{shared} of width {spec.expert_hidden}, "
                   f"top-{spec.top_k}")
            if spec.router_imbalance:
                kv += f", router imbalance {spec.router_imbalance:g}"
        out[name] = (
            f"{spec.kind}: {spec.layers} layers, hidden {spec.hidden}, {spec.heads} heads{kv}, "
            f"ffn {spec.ffn_hidden}, vocab {spec.vocab}, seq {spec.seq_len}, "
            f"{num_params(spec) / 1e9:.2f}B params; {source}"
        )
    return out
