"""Attributes a package loads on first use (PEP 562), so heavy or optional imports wait."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

__all__ = ["lazy_attribute"]


def lazy_attribute(package: str, table: Mapping[str, str], name: str) -> Any:
    """The attribute ``name`` of the module ``table[name]``, for a package's ``__getattr__``.

    Raises:
        AttributeError: ``name`` is not in ``table``.
    """
    if name not in table:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(table[name]), name)
