"""``autopar verify PLAN``: measured vs predicted figures of a plan (work: runtime/verify.py)."""

from __future__ import annotations

import argparse

NAME = "verify"
HELP = (
    "run a plan briefly; measured vs predicted step time and memory"
    " (--refit fits the cluster)"
)
ORDER = 85


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``verify``'s arguments (the runtime's own list)."""
    from autopar.runtime.verify import add_verify_arguments

    add_verify_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Delegate to the runtime."""
    from autopar.runtime.verify import verify_command

    return verify_command(args)
