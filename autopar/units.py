"""Binary byte units, defined once (IEC: 1 KiB = 2**10 bytes, 1 MiB = 2**20, 1 GiB = 2**30)."""

from __future__ import annotations

__all__ = ["GIB", "KIB", "MIB"]

KIB = 2**10
MIB = 2**20
GIB = 2**30
