"""Binary byte units, defined once (IEC: 1 KiB = 2**10 bytes, 1 MiB = 2**20, 1 GiB = 2**30), and
their text (``format_bytes``)."""

from __future__ import annotations

__all__ = ["GIB", "KIB", "MIB", "format_bytes"]

KIB = 2**10
MIB = 2**20
GIB = 2**30


def format_bytes(num_bytes: float, digits: int = 1) -> str:
    """``1.5 GiB``-style text: the largest binary unit that keeps the number >= 1, with
    ``digits`` decimals (bytes as a whole number)."""
    value, unit = float(num_bytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.{digits}f} {unit}"
