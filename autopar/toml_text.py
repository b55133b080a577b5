"""TOML text for the exports: basic strings that read back exactly, comments on one line.

Written by hand (the standard library reads TOML, ``tomllib``, but does not write it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["one_line", "toml_document", "toml_string", "toml_value"]


# TOML basic-string escapes (TOML 1.0, "String"); other control characters become \uXXXX.
_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n",
                 "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string, ASCII only (``tomllib`` reads back exactly ``text``).

    Quote, backslash and control characters (U+0000..U+001F, U+007F) are escaped, and so is
    every non-ASCII character (``\\uXXXX`` / ``\\UXXXXXXXX``).

    Raises:
        ValueError: ``text`` holds a lone surrogate, which no TOML (or UTF-8) string can carry.
    """
    out = []
    for char in text:
        code = ord(char)
        if 0xD800 <= code <= 0xDFFF:
            raise ValueError(f"plan string {text!r} is not valid Unicode (a lone surrogate)")
        if char in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[char])
        elif code < 0x20 or code == 0x7F or 0x80 <= code <= 0xFFFF:
            out.append(f"\\u{code:04X}")
        elif code > 0xFFFF:
            out.append(f"\\U{code:08X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def one_line(text: str) -> str:
    """``text`` for a comment: printable ASCII on one line (escapes as Python writes them)."""
    return text.encode("unicode_escape", errors="backslashreplace").decode("ascii")


def toml_value(value: Any) -> str:
    """A TOML value: booleans, numbers, arrays, else a basic string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return toml_string(str(value))


def toml_document(tables: dict[str, dict[str, Any]], header: str) -> str:
    """A TOML document of ``tables`` under a one-line comment ``header``."""
    lines = [f"# {one_line(header)}"]
    for name, table in tables.items():
        lines.append("")
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in table.items())
    return "\n".join(lines) + "\n"
