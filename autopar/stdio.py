"""Keep stdout for the document alone (``--json``, ``export``): one helper for every command."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

__all__ = ["document_stdout"]


@contextlib.contextmanager
def document_stdout() -> Iterator[Callable[[str], None]]:
    """Point file descriptor 1 at stderr while the block runs; yield a writer to real stdout.

    Whatever a library prints meanwhile (a solver banner written from C, a warning, torchrun's
    chatter) lands on stderr, and the document the yielded function writes is the only thing on
    stdout.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = os.fdopen(os.dup(saved), "w")

    def write(text: str) -> None:
        real.write(text)
        real.flush()

    try:
        yield write
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        real.close()
