"""``autopar estimate MODEL --dp D --tp T --pp P [--cp C --dp-replicate R --offload O --dtype T]``:
one split's prediction, as a report."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from autopar.cli import common
from autopar.cli.argtypes import int_in
from autopar.config import DTYPES, MAX_GLOBAL_BATCH, OFFLOADS, RECOMPUTE, SCHEDULES
from autopar.cost_model.hardware import MAX_GPUS
from autopar.schedules import DEFAULT_SCHEDULE, get_schedule

NAME = "estimate"
HELP = "predict time and memory of one given split of MODEL"
ORDER = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``estimate``'s arguments."""
    common.add_model_argument(parser)
    common.add_cluster_arguments(parser)
    split = parser.add_argument_group("split")
    for name in ("dp", "cp", "tp", "pp"):
        split.add_argument(
            f"--{name}", type=int_in(1, MAX_GPUS), default=1, help=f"{name} degree (default 1)"
        )
    split.add_argument("--ep", type=int_in(1, MAX_GPUS), default=1,
                       help="expert-parallel degree of a mixture-of-experts model (divides dp; "
                       "default 1)")
    split.add_argument("--dp-replicate", type=int_in(1, MAX_GPUS), default=1,
                       help="HSDP replicas of a dp / dp_replicate shard group (needs --zero >= 1)")
    split.add_argument("--offload", default="none", choices=OFFLOADS,
                       help="optimizer state (and parameters) in host memory (needs --zero >= 1)")
    split.add_argument("--micro-batch", type=int_in(1, MAX_GLOBAL_BATCH), default=1,
                       help="sequences per micro-batch")
    split.add_argument("--global-batch", type=int_in(1, MAX_GLOBAL_BATCH), required=True,
                       help="sequences per step")
    split.add_argument("--schedule", default=DEFAULT_SCHEDULE, choices=SCHEDULES)
    split.add_argument(
        "--virtual-stages", type=int_in(1, 1024), default=None,
        help="chunks per rank (interleaved: 2)",
    )
    split.add_argument("--recompute", default="none", choices=RECOMPUTE)
    split.add_argument("--sequence-parallel", action="store_true")
    split.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    split.add_argument("--dtype", default="bf16", choices=DTYPES)
    common.add_framework_argument(parser)
    common.add_output_arguments(parser)


def config_from_args(args: argparse.Namespace) -> Any:
    """The ParallelConfig the flags describe (ValueError names a bad field)."""
    from autopar.config import ParallelConfig

    virtual = args.virtual_stages
    if virtual is None:
        virtual = get_schedule(args.schedule).default_virtual_stages(args.pp)
    return ParallelConfig(
        dp=args.dp,
        cp=args.cp,
        dp_replicate=args.dp_replicate,
        offload=args.offload,
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        schedule=args.schedule,
        virtual_stages=virtual,
        recompute=args.recompute,
        sequence_parallel=args.sequence_parallel,
        zero=args.zero,
        dtype=args.dtype,
    )


def run(args: argparse.Namespace) -> int:
    """Estimate the split; report it (or print its plan JSON) and save ``--out`` / ``--plot``."""
    from autopar.search import plan_from_config

    config = config_from_args(args)
    common.check_outputs(args)
    stream = common.document_stdout() if args.json else contextlib.nullcontext(print)
    with stream as emit:
        cluster = common.cluster_from_args(args, default_gpus=config.world_size)
        profile = common.load_profile(args.model, args.seq_len, timeout_s=args.build_timeout,
                                      loss=args.loss)
        plan = plan_from_config(profile, cluster, config, model=args.model,
                                framework=args.framework)
        common.save_outputs(plan, args)  # first: a closed stdout must not lose the files
        if args.json:
            emit(plan.to_json())
        else:
            common.print_plan_report(plan, cluster)
    return 0
