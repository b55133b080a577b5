"""``autopar export plan.json --to torchtitan|megatron|deepspeed|slurm``: another tool's config."""

from __future__ import annotations

import argparse
import sys

from autopar.cli import common
from autopar.cli.argtypes import MAX_STEPS, int_in
from autopar.errors import AutoparError
from autopar.units import format_bytes

NAME = "export"
HELP = "write a plan as a torchtitan TOML, Megatron-LM flags, a DeepSpeed JSON or an sbatch script"
ORDER = 50
SLURM_STEPS = 100  # the sbatch script's `autopar run --steps` unless --steps is given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``export``'s arguments."""
    from autopar.exporters import EXPORTERS

    parser.add_argument("plan", metavar="PLAN", help="a plan JSON file")
    parser.add_argument("--to", required=True, choices=list(EXPORTERS), help="target format")
    parser.add_argument("--out", default=None, metavar="FILE", help="write here (default stdout)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.add_argument(
        "--steps", type=int_in(1, MAX_STEPS), default=None,
        help=f"slurm: training steps for `autopar run` (default {SLURM_STEPS})"
    )


def run(args: argparse.Namespace) -> int:
    """Export; the document alone goes to stdout (or --out), notes go to stderr."""
    from autopar.exporters import export_plan

    if args.steps is not None and args.to != "slurm":
        raise AutoparError(f"--steps goes with --to slurm (the steps its `autopar run` "
                           f"trains); drop it for --to {args.to}")
    common.check_writable(args.out, force=args.force, reads=(args.plan,))
    plan = common.load_plan_file(args.plan)
    steps = SLURM_STEPS if args.steps is None else args.steps
    options = {"plan_path": args.plan, "steps": steps} if args.to == "slurm" else {}
    result = export_plan(plan, args.to, **options)
    for note in result.notes:
        print(f"autopar: note: {note}", file=sys.stderr)
    if not plan.estimate.fits:  # an export of it would run out of memory
        est = plan.estimate
        print(f"autopar: note: the plan's estimate does not fit "
              f"({format_bytes(est.memory_per_gpu_bytes)} per GPU of "
              f"{format_bytes(est.memory_capacity_bytes)} usable)", file=sys.stderr)
    if args.out:
        common.write_output(args.out, result.text, force=args.force)
        print(f"autopar: wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    return 0
