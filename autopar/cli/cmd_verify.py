"""``autopar verify PLAN``: measured vs predicted figures of a plan.

The prediction and the run are ``autopar.runtime.verify.verify_plan``'s; this module reads the
inputs, checks the flags, refits the cluster (``--refit``) and prints the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from autopar.cli import common
from autopar.cli.argtypes import MAX_SEED, MAX_STEPS, int_in
from autopar.cost_model.framework_names import DEFAULT_FRAMEWORK
from autopar.errors import AutoparError

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
    parser.add_argument("--steps", type=int_in(1, MAX_STEPS), default=6,
                        help="steps to run (default 6)")
    parser.add_argument("--warmup", type=int_in(0, MAX_STEPS), default=2,
                        help="leading steps not timed (default 2)")
    parser.add_argument("--cluster", default=None, metavar="YAML",
                        help="predict on this cluster (default: the cluster the plan carries)")
    parser.add_argument("--model", default=None, type=common.model_name,
                        help="the model (default: the plan's own; a .py model file runs only "
                        "when named here)")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                        help="seed of the weights and data")
    parser.add_argument("--refit", action="store_true",
                        help="rescale the cluster's compute efficiency to the measurement")
    parser.add_argument("--out", default=None, metavar="YAML",
                        help="with --refit: where to write the refitted cluster")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--framework", default=DEFAULT_FRAMEWORK, type=framework_spec,
                        metavar="NAME[+SETTING...]",
                        help="predict as this framework would run the plan (default autopar: "
                        "the runtime verify runs)")


def run(args: argparse.Namespace) -> int:
    """Run ``autopar verify`` (see ``verify_command``)."""
    return verify_command(args)


def _load_inputs(args: argparse.Namespace) -> tuple[Any, Any]:
    from autopar.cost_model.hardware import Cluster

    path = Path(args.plan)
    plan = common.load_plan_file(args.plan)
    if args.cluster:
        cluster = Cluster.from_yaml(args.cluster)
    elif plan.cluster:
        cluster = Cluster.from_dict(plan.cluster)
    else:
        raise AutoparError(f"plan {path} carries no cluster; pass --cluster cluster.yaml")
    return plan, cluster


def _hardware_note(cluster: Any) -> str:
    """A line when the run's hardware is not the prediction's: the errors then compare a CPU
    run with a GPU's prediction, not the cost model with its runtime."""
    import torch

    if torch.cuda.is_available() or cluster.device.name.startswith("cpu"):
        return ""
    return (f"  note: the run is on CPU processes and the prediction for {cluster.device.name}: "
            "the error column compares the two machines; pass --cluster with a CPU cluster "
            "(`autopar calibrate`) to check the cost model here\n")


def verify_command(args: argparse.Namespace) -> int:
    """Run ``autopar verify``; returns the exit code.

    Raises:
        AutoparError: unreadable inputs, --refit without --out, an existing --out without
            --force, or failed workers.
    """
    from autopar.cost_model.calibration import refit_cluster
    from autopar.runtime.verify import format_verification, verify_plan

    if args.refit:
        if not args.out:
            raise AutoparError("--refit needs --out new_cluster.yaml (where to write the cluster)")
        # before the run, not after it; never over the plan it reads
        common.check_writable(args.out, force=args.force, reads=(args.plan,))
    elif args.out:
        raise AutoparError("--out goes with --refit")
    plan, cluster = _load_inputs(args)
    # The run here is autopar's runtime; --framework predicts as another framework would.
    plan = dataclasses.replace(plan, framework=getattr(args, "framework", DEFAULT_FRAMEWORK))
    result = verify_plan(plan, cluster, model_text=args.model or "", steps=args.steps,
                         warmup_steps=args.warmup, seed=args.seed)
    record = result.to_dict()
    text = format_verification(result) + _hardware_note(cluster)
    if args.refit:
        new = refit_cluster(cluster, result.estimate["time_breakdown"],
                            result.measured_step_time_s)
        common.write_output(args.out, new.to_yaml_text(), force=args.force)
        record["refit_cluster"] = new.to_dict()
        text += (
            f"  refit: matmul_efficiency_max {cluster.device.matmul_efficiency_max:.4g} -> "
            f"{new.device.matmul_efficiency_max:.4g}; wrote {args.out}\n"
        )
    if args.json:
        print(text, end="", file=sys.stderr)
        print(json.dumps(record, sort_keys=True))
    else:
        print(text, end="")
    return 0
