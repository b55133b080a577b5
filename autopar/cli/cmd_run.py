"""``autopar run PLAN_OR_MODEL``: train a plan with torchrun (arguments and work: runtime)."""

from __future__ import annotations

import argparse

NAME = "run"
HELP = "train a plan (or a given split of a model) on synthetic data and report what it did"
ORDER = 80


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``run``'s arguments (the runtime's own list)."""
    from autopar.runtime.run import add_run_arguments

    add_run_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Delegate to the runtime."""
    from autopar.runtime.run import run_command

    return run_command(args)
