"""``autopar sweep MODEL --gpus 64,128 --gpu a100-80g,h100 --tokens 300e9``: size the job."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from typing import Any

from autopar.cli import common
from autopar.cli.argtypes import int_in, positive_float
from autopar.config import MAX_GLOBAL_BATCH
from autopar.cost_model.hardware import MAX_GPU_MEMORY_GB, MAX_GPUS

NAME = "sweep"
HELP = "best plan per GPU count and GPU kind: throughput, days to train, cost, Pareto front"
ORDER = 60
# Default step size when --global-batch is not given: about 4M tokens (GPT-3 used 3.2M,
# Llama 3 started at 4M), as a power of two so that every power-of-two dp divides it.
DEFAULT_BATCH_TOKENS = 4 * 2**20


def _int_list(text: str) -> list[int]:
    try:
        values = [int_in(1, MAX_GPUS)(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one GPU count")
    return list(dict.fromkeys(values))  # a count given twice is planned once


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``sweep``'s arguments."""
    common.add_model_argument(parser)
    parser.add_argument("--gpus", type=_int_list, required=True, help="GPU counts: 64,128,256")
    parser.add_argument("--gpu", default=common.DEFAULT_GPU, help="GPU presets: a100-80g,h100")
    parser.add_argument(
        "--gpu-memory", type=positive_float(MAX_GPU_MEMORY_GB, low=1e-3), default=None, metavar="GB"
    )
    parser.add_argument("--tokens", type=positive_float(1e30), required=True,
                        help="tokens to train on: 300e9")
    parser.add_argument(
        "--global-batch", type=int_in(1, MAX_GLOBAL_BATCH), default=None,
        help="sequences per step (default ~4M tokens)",
    )
    parser.add_argument(
        "--price-per-gpu-hour", default=None, metavar="X", help="2.5 or a100-80g=1.8,h100=3.2"
    )
    parser.add_argument("--time-budget", type=positive_float(common.MAX_SECONDS), default=None,
                        metavar="S", help="per point")
    parser.add_argument("--plot", default=None, metavar="PNG", help="days against cost")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --plot")
    parser.add_argument("--json", action="store_true", help="print the points as JSON")
    common.add_framework_argument(parser)


def _clusters(args: argparse.Namespace, gpus: list[str]) -> list[tuple[str, int, Any]]:
    from autopar.cost_model.hardware import Cluster

    out = []
    for gpu in gpus:
        for count in args.gpus:
            nodes, per_node = common.split_gpu_count(count)
            cluster = Cluster.preset(
                gpu, nodes=nodes, gpus_per_node=per_node, gpu_memory_gb=args.gpu_memory
            )
            out.append((gpu, count, cluster))
    return out


def _table(points: Any) -> Any:
    from rich.table import Table

    from autopar.report import format_count

    table = Table(title="Sweep (* = Pareto front: no point is both faster and cheaper)")
    for column in ("", "gpu", "GPUs", "best split", "tokens/s", "MFU", "days", "GPU-hours", "cost"):
        table.add_column(column)
    for p in points:
        if p.error:
            table.add_row("", p.gpu, str(p.num_gpus), f"[red]{p.error}[/red]", *[""] * 5)
            continue
        table.add_row(
            "*" if p.pareto else "",
            p.gpu,
            str(p.num_gpus),
            p.split,
            format_count(p.tokens_per_s),
            f"{p.mfu * 100:.1f}%",
            f"{p.days:.1f}",
            format_count(p.gpu_hours),
            "" if p.cost is None else f"{p.cost:,.0f}",
        )
    return table


def run(args: argparse.Namespace) -> int:
    """Plan every point, print the table (or JSON), write the plot."""
    from autopar.sweep import parse_prices, sweep

    gpus = list(dict.fromkeys(g.strip() for g in args.gpu.split(",") if g.strip()))
    if not gpus:
        raise ValueError(f"--gpu {args.gpu!r} names no GPU preset; give one or more: a100-80g,h100")
    prices = parse_prices(args.price_per_gpu_hour, gpus)
    if args.tokens <= 0:
        raise ValueError(f"--tokens must be positive, got {args.tokens}")
    common.check_plot_path(args.plot, force=args.force)
    stream = common.document_stdout() if args.json else contextlib.nullcontext(print)
    with stream as emit:
        profile = common.load_profile(args.model, args.seq_len, timeout_s=args.build_timeout,
                                      loss=args.loss, framework=args.framework)
        batch = args.global_batch or 2 ** round(math.log2(DEFAULT_BATCH_TOKENS / profile.seq_len))
        if args.global_batch is None:
            print(f"autopar: global batch {batch} sequences (--global-batch)", file=sys.stderr)
        clusters = _clusters(args, gpus)
        with common.progress_bar("sweeping") as progress:
            points = sweep(
                profile,
                clusters=clusters,
                global_batch=batch,
                tokens=args.tokens,
                prices=prices,
                time_budget_s=args.time_budget,
                progress=progress,
                model=args.model,
                framework=args.framework,
            )
        if args.json:
            emit(json.dumps([p.to_dict() for p in points], indent=2) + "\n")
        else:
            common.make_console(stderr=False).print(_table(points))
        if args.plot and any(not p.error for p in points):
            from autopar.plotting import plot_sweep

            title = f"{args.model}: {args.tokens:.3g} tokens, global batch {batch}"
            common.write_output(args.plot, plot_sweep(points, title), force=args.force)
            print(f"autopar: wrote {args.plot}", file=sys.stderr)
    if all(p.error for p in points):  # nothing planned: the command failed (as plan does)
        print(f"autopar: error: no point of the sweep has a plan; the first: {points[0].error}",
              file=sys.stderr)
        return 2
    return 0
