"""``autopar plan MODEL``: search the best split, report it, save it, plot it."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from autopar.cli import common
from autopar.cli.argtypes import int_in, positive_float
from autopar.config import DTYPES, MAX_GLOBAL_BATCH, MAX_SEQ_LEN, OFFLOADS
from autopar.cost_model.hardware import MAX_GPUS
from autopar.errors import AutoparError

NAME = "plan"
HELP = "find the best split of MODEL over a cluster"
ORDER = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``plan``'s arguments."""
    common.add_model_argument(parser)
    common.add_cluster_arguments(parser)
    parser.add_argument("--global-batch", type=int_in(1, MAX_GLOBAL_BATCH), required=True,
                        help="sequences per step")
    parser.add_argument("--top-k", type=int_in(1, 100), default=3,
                        help="alternatives to keep (default 3)")
    parser.add_argument(
        "--time-budget", type=positive_float(common.MAX_SECONDS), default=None, metavar="S",
        help="time limit of the whole command (model building included), seconds",
    )
    common.add_framework_argument(parser)
    space = parser.add_argument_group("search space (default: every dimension the framework runs)")
    space.add_argument("--dtype", default=None, choices=DTYPES,
                       help="train in this dtype (default: bf16, fp16 on V100, fp8 where the GPU "
                       "and the framework run it and it is faster)")
    space.add_argument("--no-cp", action="store_true", help="no context parallelism")
    space.add_argument("--max-cp", type=int_in(1, MAX_GPUS), default=None,
                       help="largest context-parallel degree")
    # default None: the search's own floor (SearchOptions.min_cp_tokens), which the help names
    # (a test holds the two equal) without importing the search here.
    space.add_argument("--min-cp-tokens", type=int_in(1, MAX_SEQ_LEN), default=None,
                       metavar="T", help="fewest tokens per context-parallel rank "
                       "(sequence / cp) to consider (default 8192)")
    space.add_argument("--max-virtual-stages", type=int_in(2, 64), default=4, metavar="V",
                       help="most model chunks a pipeline rank holds in interleaved schedules "
                       "(default 4)")
    space.add_argument("--no-hsdp", action="store_true", help="no HSDP (dp_replicate = 1)")
    space.add_argument("--no-offload", action="store_true",
                       help="never offload optimizer state or parameters to host memory")
    space.add_argument("--no-setting-search", action="store_true",
                       help="plan the framework with exactly the settings named (by default "
                       "settings that are parallelism choices, such as expert-tp-1, are tried)")
    parser.add_argument(
        "--robust", action="store_true",
        help="pick the plan with the best pessimistic step time (high end of its interval) "
        "that fits with the framework's memory band",
    )
    common.add_output_arguments(parser)


def search(
    args: argparse.Namespace, profile: Any, cluster: Any, time_budget_s: float | None
) -> list[Any]:
    """Run the planner with a progress bar; the plans, best first."""
    # NOTE: autopar.search.plan, not autopar.plan: once the autopar.plan module (Plan records)
    # is imported, the package attribute `plan` names that module, not the function.
    from autopar.search import SearchOptions
    from autopar.search import plan as search_plan

    floor = {} if args.min_cp_tokens is None else {"min_cp_tokens": args.min_cp_tokens}
    with common.progress_bar("searching") as progress:
        result = search_plan(
            profile,
            cluster,
            global_batch=args.global_batch,
            top_k=args.top_k,
            progress=progress,
            time_budget_s=time_budget_s,
            model=args.model,
            options=SearchOptions(
                framework=args.framework, robust=args.robust, dtype=args.dtype,
                context_parallel=not args.no_cp, max_cp=args.max_cp, hsdp=not args.no_hsdp,
                max_virtual_stages=args.max_virtual_stages,
                offloads=("none",) if args.no_offload else OFFLOADS,
                settings_search=not args.no_setting_search, **floor,
            ),
        )
    return list(result) if isinstance(result, (list, tuple)) else [result]


def run(args: argparse.Namespace) -> int:
    """Plan, then print the report (or the JSON) and write ``--out`` / ``--plot``."""
    from autopar.cli.alternatives import alternatives_for

    common.check_outputs(args)
    given = [f for f, v in (("--max-cp", args.max_cp), ("--min-cp-tokens", args.min_cp_tokens))
             if v is not None]
    if args.no_cp and given:
        verb = "shapes" if len(given) == 1 else "shape"
        raise AutoparError(f"{' and '.join(given)} {verb} the context parallelism --no-cp "
                           "turns off; drop one or the other")
    clock = common.Budget(args.time_budget)
    stream = common.document_stdout() if args.json else contextlib.nullcontext(print)
    with stream as emit:
        cluster = common.cluster_from_args(args)
        common.load_profiler()  # its import time is the budget's too
        profile = common.load_profile(
            args.model, args.seq_len, timeout_s=clock.limit(args.build_timeout), loss=args.loss,
            framework=args.framework)
        plans = search(args, profile, cluster, clock.left("searching"))
        best = plans[0]
        common.save_outputs(best, args)  # first: a closed stdout must not lose the files
        if args.json:
            emit(best.to_json())
        else:
            alternatives = alternatives_for(profile, cluster, best, plans[1:])
            common.print_plan_report(best, cluster, alternatives=alternatives)
    return 0
