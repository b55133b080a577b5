"""``autopar estimate MODEL --dp D --tp T --pp P [--cp C --dp-replicate R --offload O --dtype T]``:
one split's prediction, as a report."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from autopar.cli import common
from autopar.cli.split_args import add_split_arguments
from autopar.schedules import get_schedule

NAME = "estimate"
HELP = "predict time and memory of one given split of MODEL"
ORDER = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``estimate``'s arguments."""
    common.add_model_argument(parser)
    common.add_cluster_arguments(parser)
    add_split_arguments(parser.add_argument_group("split"), for_run=False)
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
                                      loss=args.loss, framework=args.framework)
        plan = plan_from_config(profile, cluster, config, model=args.model,
                                framework=args.framework)
        common.save_outputs(plan, args)  # first: a closed stdout must not lose the files
        if args.json:
            emit(plan.to_json())
        else:
            common.print_plan_report(plan, cluster)
    return 0
