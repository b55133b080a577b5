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
    """Declare ``verify``'s arguments."""
    add_verify_arguments(parser)


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the arguments of ``autopar verify`` on ``parser``."""
    from autopar.cli.argtypes import framework_spec

    parser.add_argument("plan", metavar="PLAN", help="a plan JSON file (autopar plan --out)")
    parser.add_argument("--steps", type=int, default=6, help="steps to run (default 6)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="leading steps not timed (default 2)")
    parser.add_argument("--cluster", default=None, metavar="YAML",
                        help="predict on this cluster (default: the cluster the plan carries)")
    parser.add_argument("--model", default=None,
                        help="the model (default: the plan's own; a .py model file runs only "
                        "when named here)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and data")
    parser.add_argument("--refit", action="store_true",
                        help="rescale the cluster's compute efficiency to the measurement")
    parser.add_argument("--out", default=None, metavar="YAML",
                        help="with --refit: where to write the refitted cluster")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--framework", default="autopar", type=framework_spec,
                        metavar="NAME[+SETTING...]",
                        help="predict as this framework would run the plan (default autopar: "
                        "the runtime verify runs)")


def run(args: argparse.Namespace) -> int:
    """Delegate to the runtime."""
    from autopar.runtime.verify import verify_command

    return verify_command(args)
