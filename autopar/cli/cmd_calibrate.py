"""``autopar calibrate``: measure this machine into a cluster YAML (work: runtime/calibrate.py)."""

from __future__ import annotations

import argparse

NAME = "calibrate"
HELP = "measure this machine's compute and collectives into a cluster YAML"
ORDER = 90


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``calibrate``'s arguments (the runtime's own list)."""
    from autopar.runtime.calibrate import add_calibrate_arguments

    add_calibrate_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Delegate to the runtime."""
    from autopar.runtime.calibrate import calibrate_command

    return calibrate_command(args)
