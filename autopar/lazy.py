"""Attributes a package loads on first use (PEP 562), so heavy or optional imports wait."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attribute", "lazy_getattr"]


def lazy_attribute(package: str, table: Mapping[str, str], name: str) -> Any:
    """The attribute ``name`` of the module ``table[name]``, for a package's ``__getattr__``;
    the module itself where its own name ends in ``name`` (a subpackage, ``autopar.models``).

    Raises:
        AttributeError: ``name`` is not in ``table``.
    """
    if name not in table:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module = importlib.import_module(table[name])
    return module if table[name].rpartition(".")[2] == name else getattr(module, name)


def lazy_getattr(
    package: str, table: Mapping[str, str], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """A package's ``__getattr__`` over ``table``: each attribute loaded once, then kept in the
    package's ``namespace`` (its ``globals()``)."""

    def __getattr__(name: str) -> Any:
        value = lazy_attribute(package, table, name)
        namespace[name] = value
        return value

    return __getattr__
