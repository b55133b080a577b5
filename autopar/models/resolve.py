"""Turn the MODEL argument of the CLI into a model builder.

MODEL may be a path to a ``.py`` model file, a path to an HF config JSON (recognised by its
``model_type`` key), a zoo preset name (``gpt3-175b``), or a zoo kind with its sizes
(``gpt:layers=4,hidden=64,heads=4,vocab=256,seq_len=32``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from autopar.errors import UnknownModelError
from autopar.json_data import read_json
from autopar.models.presets import PRESETS
from autopar.models.spec import KINDS
from autopar.models.zoo import SHAPE_KEYS, build, make_spec, suggest_names

__all__ = ["ModelBuilder", "model_notes", "parse_model_spec", "resolve_model"]

# build_model(device="meta", *, dtype=..., seed=None) -> nn.Module
ModelBuilder = Callable[..., nn.Module]

_FLOAT_KEYS = ("dropout", "rope_theta", "capacity_factor", "router_imbalance")
_BOOL_KEYS = ("tie_embeddings",)
_STR_KEYS = ("attention",)
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")


# Plain decimal numbers only: Python's int() and float() also take "4_0", " 4", other
# scripts' digits, "nan" and "inf", which a spec would then read as another size.
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _parse_value(text: str, key: str, value: str) -> Any:
    try:
        if key in _FLOAT_KEYS:
            if not _FLOAT.fullmatch(value):
                raise ValueError(value)
            return float(value)
        if key in _STR_KEYS:
            return value
        if key in _BOOL_KEYS:
            if value.lower() not in _TRUE + _FALSE:
                raise ValueError(value)
            return value.lower() in _TRUE
        if not _INT.fullmatch(value):
            raise ValueError(value)
        return int(value)
    except ValueError:
        raise UnknownModelError(
            f"model spec {text!r}: {key}={value!r} is not a valid value for {key}"
        ) from None


def parse_model_spec(text: str) -> tuple[str, dict[str, Any]]:
    """Parse ``kind:key=value,...`` into ``(kind, shape)``.

    Args:
        text: e.g. ``"llama:layers=4,hidden=64,heads=4,kv_heads=2,vocab=256,seq_len=32"``.

    Returns:
        The kind and a dict of sizes (ints; floats for dropout/rope_theta; a bool for
        tie_embeddings; a string for attention), checked by building the ModelSpec.

    Raises:
        UnknownModelError: bad syntax, an unknown kind or key, or sizes that do not fit.
    """
    kind, sep, rest = text.partition(":")
    kind = kind.strip()
    if not sep or kind not in KINDS:
        raise UnknownModelError(
            f"model spec {text!r}: expected KIND:key=value,... with KIND one of "
            f"{', '.join(KINDS)}.{suggest_names(kind)}"
        )
    shape: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not key or not value:
            raise UnknownModelError(f"model spec {text!r}: {item!r} is not key=value")
        if key not in SHAPE_KEYS[kind]:
            raise UnknownModelError(
                f"model spec {text!r}: unknown key {key!r} for {kind}; "
                f"known keys: {', '.join(SHAPE_KEYS[kind])}"
            )
        if key in shape:
            raise UnknownModelError(f"model spec {text!r}: {key} is given twice")
        shape[key] = _parse_value(text, key, value)
    try:
        make_spec(kind, **shape)
    except ValueError as err:
        raise UnknownModelError(f"model spec {text!r}: {err}") from None
    return kind, shape


def _zoo_builder(name: str, shape: dict[str, Any]) -> ModelBuilder:
    def build_model(device: Any = "meta", **kwargs: Any) -> nn.Module:
        return build(name, device=device, **shape, **kwargs)

    return build_model


def _json_builder(path: Path) -> tuple[ModelBuilder, str]:
    data = read_json(path, str(path), "an HF config", UnknownModelError)
    if isinstance(data, dict) and "schema_version" in data:
        raise UnknownModelError(
            f"{path} is an autopar plan, not a model; pass the model it was made for "
            f"(or use a command that takes a plan, such as 'autopar show' or 'autopar run')"
        )
    if not isinstance(data, dict) or "model_type" not in data:
        raise UnknownModelError(
            f"{path} is neither an HF config (no 'model_type' key) nor an autopar plan"
        )
    from autopar.models.hf import from_hf_config

    def build_model(device: Any = "meta", **kwargs: Any) -> nn.Module:
        return from_hf_config(data, device=device, **kwargs)

    return build_model, f"HF {data['model_type']} config {path.name}"


def resolve_model(text: str) -> tuple[ModelBuilder, str]:
    """Recognise a MODEL argument and return ``(build_model, description)``.

    ``build_model(device="meta", *, dtype=..., seed=None)`` builds the model. For a model file
    it is ``ModelFile.instantiate`` (the file's ``build_model()`` under that default device),
    except that calling it without ``device`` keeps the caller's default device.

    Args:
        text: a ``.py`` model file, an HF config ``.json``, a preset name, or ``kind:k=v,...``.

    Returns:
        The builder and a short description ("zoo preset gpt3-175b", "model file m.py", ...).

    Raises:
        UnknownModelError: none of the forms matches (with close-name suggestions), or the JSON
            is a plan or not an HF config.
        ModelFileError: the model file is broken (see ``load_model_file``).
    """
    path = Path(text)
    if text.endswith(".py"):
        from autopar.models.model_file import load_model_file

        model_file = load_model_file(path)

        def build_from_file(device: Any = None, **kwargs: Any) -> nn.Module:
            # device None: the caller's default device (its own ``with torch.device(...)``).
            return model_file.instantiate(device, **kwargs)

        return build_from_file, f"model file {path.name}"
    if text.endswith(".json"):
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise UnknownModelError(f"config file {text} {what}")
        return _json_builder(path)
    if text in PRESETS:
        return _zoo_builder(text, {}), f"zoo preset {text}"
    if ":" in text:
        kind, shape = parse_model_spec(text)
        return _zoo_builder(kind, shape), f"zoo {text}"
    raise UnknownModelError(
        f"unknown model {text!r}.{suggest_names(text)} Give a preset name (see "
        f"autopar.models.list_presets()), KIND:key=value,... with KIND one of {', '.join(KINDS)}, "
        f"a .py model file, or an HF config .json"
    )


def model_notes(text: str) -> tuple[str, ...]:
    """What the MODEL argument asks for that a plan does not model (an HF config's
    quantization), in words for stderr notes; () for every other form."""
    if not text.endswith(".json"):
        return ()
    from autopar.models.hf import hf_config_notes

    data = read_json(Path(text), text, "an HF config", UnknownModelError)
    return hf_config_notes(data) if isinstance(data, dict) else ()
