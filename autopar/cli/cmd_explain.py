"""``autopar explain plan.json``: the plan's memory and time formulas with its numbers in them."""

from __future__ import annotations

import argparse

from autopar.cli import common
from autopar.cli.argtypes import int_in
from autopar.config import MAX_SEQ_LEN
from autopar.errors import AutoparError

NAME = "explain"
HELP = "show the symbolic memory and time formulas of a plan, numbers substituted"
ORDER = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``explain``'s arguments."""
    parser.add_argument("plan", metavar="PLAN", help="a plan JSON file")
    parser.add_argument(
        "--model", default=None, type=common.model_name,
        help="the model the plan was made for (default: the plan's own; a .py model file runs "
        "only when named here)",
    )
    parser.add_argument("--seq-len", type=int_in(1, MAX_SEQ_LEN), default=None,
                        help="tokens per sequence")
    common.add_build_timeout(parser)


def run(args: argparse.Namespace) -> int:
    """Rebuild the plan's model and cluster, check the fingerprints, print the formulas."""
    plan = common.load_plan_file(args.plan)
    profile, cluster = common.plan_context(plan, args.model, args.seq_len,
                                           timeout_s=args.build_timeout)
    try:
        from autopar.costing import explain_plan
    except ImportError as e:
        raise AutoparError(
            "autopar explain is not available in this build: the symbolic cost model "
            "(autopar.cost_model.symbolic) is missing; `autopar show PLAN` prints the numbers"
        ) from e
    print(explain_plan(profile, cluster, plan))
    return 0
