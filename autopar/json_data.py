"""Parse a JSON document autopar reads as data (a plan, an HF config): one error naming the
file and what is wrong with it, whatever its bytes hold (not UTF-8, invalid JSON, nested past
Python's recursion limit, an integer of more digits than Python converts, a key given twice)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError

__all__ = ["parse_json", "read_json", "read_text"]


def parse_json(text: str, where: str, expected: str, error: type[Exception] = AutoparError,
               **options: Any) -> Any:
    """``json.loads(text, **options)``, its failures raised as ``error``.

    Args:
        text: the document.
        where: what it is, for the message ("plan p.json", "HF config c.json").
        expected: what it should be ("an autopar plan").
        error: the error class to raise (an AutoparError, or PlanFormatError).
        options: ``json.loads`` keywords (``parse_constant``); an AutoparError or ``error``
            they raise passes through.
    """
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # json.loads keeps the last of two equal keys: a typo read as data, refused instead.
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise error(f"{where} gives the key {key!r} twice; keep one")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=unique, **options)
    except (AutoparError, error):
        raise
    except json.JSONDecodeError as err:
        raise error(f"{where} is not valid JSON: {err}") from None
    except RecursionError:
        raise error(f"{where} is nested too deeply; it is not {expected}") from None
    except ValueError:  # an integer of more digits than Python converts (4,300)
        raise error(f"{where} holds an integer of thousands of digits; it is not "
                    f"{expected}") from None


def read_text(path: Path, where: str, expected: str,
              error: type[Exception] = AutoparError) -> str:
    """The UTF-8 text of the file ``path``; an unreadable or non-UTF-8 file raised as ``error``."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{where} is not UTF-8 text (a binary file?); give {expected}") from None
    except OSError as err:
        raise error(f"cannot read {where}: {err.strerror or err}") from None


def read_json(path: Path, where: str, expected: str, error: type[Exception] = AutoparError,
              **options: Any) -> Any:
    """``parse_json`` of the file ``path`` (``read_text``)."""
    return parse_json(read_text(path, where, expected, error), where, expected, error, **options)
