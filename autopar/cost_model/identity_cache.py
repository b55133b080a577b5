"""A bounded memo keyed on the identity of immutable inputs, for terms a search recomputes.

A search builds thousands of cost tables from one profile, cluster and framework; terms that
read only those objects (a cp rank's local profile, the framework-driven cluster, per-profile
sums) are computed once and reused. An entry is keyed on its objects' ids plus hashable
extras and holds the objects themselves, so an id is never reused while it is cached, and a
hit checks them by identity. At most ``max_entries`` entries; a full cache starts over.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

__all__ = ["IdentityCache"]

T = TypeVar("T")


class IdentityCache(Generic[T]):
    """``get(objects, extra, build)``: ``build()``'s value for these objects and ``extra``."""

    def __init__(self, max_entries: int = 16) -> None:
        self._entries: dict[tuple[Any, ...], tuple[tuple[object, ...], T]] = {}
        self._max = max_entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, objects: tuple[object, ...], extra: Hashable, build: Callable[[], T]) -> T:
        """The cached value of ``objects`` (by identity) and ``extra``, built on a miss."""
        key = (*map(id, objects), extra)
        hit = self._entries.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], objects)):
            return hit[1]
        value = build()
        if len(self._entries) >= self._max:
            self._entries.clear()
        self._entries[key] = (objects, value)
        return value
