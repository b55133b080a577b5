"""Bound a block of user code (a model file's ``build_model``, tracing) by wall-clock time.

How: ``SIGALRM`` from ``signal.setitimer``. Python runs the handler between bytecodes of the main
thread, so an endless Python loop in ``build_model`` is stopped within the limit; a single C call
that never returns to the interpreter (one huge torch op) is stopped when it returns. The timer
re-fires every second, and the exception it raises derives from ``BaseException``, so user code
that swallows ``except Exception`` cannot keep running. A subprocess would stop C code too, but
the model must be built in this process to be profiled; a thread cannot be stopped at all.

Outside the main thread, or where the platform has no ``setitimer`` (Windows), the block runs
unbounded.

Code that ignores ``SIGALRM`` (a model file that sets its own handler) defeats the alarm; where
the caller owns the process (the command line), ``hard_exit_after_s`` adds a watchdog thread that
ends the process with one ``autopar: error:`` line that long after the limit.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator

from autopar.errors import AutoparError

__all__ = ["MIN_SECONDS", "Expired", "TimeLimitError", "time_limit"]

_REFIRE_S = 1.0
# The shortest limit: the interval timer's resolution here (a shorter one is this long).
MIN_SECONDS = 1e-3


class TimeLimitError(AutoparError):
    """A bounded block ran past its limit."""


class Expired(BaseException):
    """Raised inside the bounded block; BaseException so ``except Exception`` cannot swallow it
    (code that catches BaseException for its own reasons, such as a model file's guard, lets it
    through)."""


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str, fix: str, *,
               hard_exit_after_s: float | None = None) -> Iterator[None]:
    """Run the block for at most ``seconds``; then raise ``TimeLimitError`` naming ``what``.

    Args:
        seconds: the limit (None or inf: no limit).
        what: what the block does, e.g. "building my_model.py".
        fix: the advice appended to the message, e.g. "raise --build-timeout".
        hard_exit_after_s: end the whole process (exit code 2) if the block is still running
            this long after the limit (module docstring); None: never.
    """
    usable = threading.current_thread() is threading.main_thread() and hasattr(
        signal, "setitimer"
    )
    if seconds is None or math.isinf(seconds) or not usable:
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise Expired

    message = f"{what} took longer than {max(seconds, MIN_SECONDS):.3g} s; {fix}"
    watchdog = None
    if hard_exit_after_s is not None:
        watchdog = threading.Timer(seconds + hard_exit_after_s, _hard_exit, (message,))
        watchdog.daemon = True
        watchdog.start()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, MIN_SECONDS), _REFIRE_S)
    try:
        yield
    except Expired:
        raise TimeLimitError(message) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if watchdog is not None:
            watchdog.cancel()


def _hard_exit(message: str) -> None:
    """The watchdog's end: the error line, then the process ends (the block ignored its alarm)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        print(f"autopar: error: {message} (its code held off the time limit)", file=sys.stderr,
              flush=True)
    os._exit(2)
