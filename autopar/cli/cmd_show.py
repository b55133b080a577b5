"""``autopar show plan.json``: the report of a saved plan (and its plot)."""

from __future__ import annotations

import argparse

from autopar.cli import common

NAME = "show"
HELP = "print the report of a saved plan"
ORDER = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``show``'s arguments."""
    parser.add_argument("plan", metavar="PLAN", help="a plan JSON file")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the plan's plot")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --plot")


def run(args: argparse.Namespace) -> int:
    """Print the saved plan's report (no model or cluster needed: the plan carries both)."""
    common.check_plot_path(args.plot, force=args.force)
    plan = common.load_plan_file(args.plan)
    common.print_plan_report(plan, None)
    common.save_outputs(plan, argparse.Namespace(plot=args.plot, force=args.force))
    return 0
