"""Helpers the subcommands share: model and cluster arguments, output files, streams, progress.

Nothing here plans or estimates; each helper turns command-line text into a library object or
writes a library result where the user asked.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from autopar.cli.argtypes import int_in, positive_float
from autopar.cli.outputs import check_plot_path, check_writable, write_output, write_outputs
from autopar.config import LOSS_KERNELS, MAX_SEQ_LEN
from autopar.cost_model.framework_names import DEFAULT_FRAMEWORK, FRAMEWORKS
from autopar.cost_model.hardware import GPUS_PER_NODE, MAX_GPU_MEMORY_GB, MAX_GPUS
from autopar.errors import AutoparError, ClusterConfigError
from autopar.stdio import document_stdout
from autopar.timelimit import MIN_SECONDS

__all__ = [
    "DEFAULT_GPU",
    "add_cluster_arguments",
    "add_model_argument",
    "add_output_arguments",
    "check_plot_path",
    "cluster_from_args",
    "document_stdout",
    "load_plan_file",
    "load_profile",
    "make_console",
    "progress_bar",
    "split_gpu_count",
    "write_output",
    "write_outputs",
]

DEFAULT_GPU = "a100-80g"
MAX_SECONDS = 7 * 24 * 3600.0  # the longest --time-budget / --build-timeout: a week
DEFAULT_BUILD_TIMEOUT_S = 120.0  # building a model on the meta device takes seconds


def model_name(text: str) -> str:
    """An argparse type: the MODEL argument, one printable line (a plan records it, and a plan
    whose model holds a tab or a terminal control could not be read back)."""
    if not text.isprintable():
        raise argparse.ArgumentTypeError(
            f"{text!r} holds a non-printable character (a tab, newline or control); rename the "
            "file, or link to it under a plain name")
    return text


model_name.__name__ = "model"


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """MODEL positional and ``--seq-len``."""
    parser.add_argument(
        "model",
        metavar="MODEL",
        type=model_name,
        help="model file (.py with build_model), zoo name (gpt3-175b, llama3-8b, ...), zoo kind "
        "with its shape (gpt:layers=4,hidden=64,heads=4,vocab=256,seq_len=32), or HF config JSON",
    )
    parser.add_argument(
        "--seq-len", type=int_in(1, MAX_SEQ_LEN), default=None,
        help="tokens per sequence (default: the model's)",
    )
    parser.add_argument(
        "--loss", choices=LOSS_KERNELS, default="eager",
        help="the training's token cross-entropy kernel: eager (torch's, fp32 log-probabilities "
        "kept; default) or fused (a fused kernel such as flash-attn's or llm-foundry's default)",
    )
    add_build_timeout(parser, "; bounded by --time-budget too")


def add_build_timeout(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--build-timeout S``: the wall-clock limit on building and profiling the model."""
    parser.add_argument(
        "--build-timeout", type=positive_float(MAX_SECONDS, low=MIN_SECONDS),
        default=DEFAULT_BUILD_TIMEOUT_S,
        metavar="S", help=f"give up building MODEL after S seconds (default "
        f"{DEFAULT_BUILD_TIMEOUT_S:g}{note})",
    )


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gpus | --nodes``, ``--gpu``, ``--gpu-memory``, ``--cluster``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--gpus", type=int_in(1, MAX_GPUS),
        help="total GPUs (8 a node; above 8 it must be a multiple of 8)",
    )
    group.add_argument("--nodes", type=int_in(1, MAX_GPUS // GPUS_PER_NODE), help="nodes of 8 GPUs")
    parser.add_argument(
        "--gpu", default=None, help=f"GPU preset (a100-80g, h100, h200, ...; default {DEFAULT_GPU})"
    )
    parser.add_argument(
        # At least 1 MB: 1e-308 GB left the device no bytes, blamed on a cluster field.
        "--gpu-memory", type=positive_float(MAX_GPU_MEMORY_GB, low=1e-3), default=None,
        metavar="GB",
        help="override the GPU's memory"
    )
    parser.add_argument("--cluster", default=None, metavar="YAML", help="cluster description file")


def add_framework_argument(parser: argparse.ArgumentParser) -> None:
    """``--framework``: the training framework a prediction is for."""
    from autopar.cli.argtypes import framework_spec

    parser.add_argument(
        "--framework", default=DEFAULT_FRAMEWORK, type=framework_spec, metavar="NAME[+SETTING...]",
        help=f"training framework that runs the split: {', '.join(FRAMEWORKS)} (default "
        f"{DEFAULT_FRAMEWORK}: this project's runtime), with the settings you turn on, e.g. "
        "megatron-lm+tp-comm-overlap+overlap-grad-reduce (docs/frameworks.md)")


def add_output_arguments(parser: argparse.ArgumentParser, *, plot: bool = True) -> None:
    """``--out``, ``--force``, ``--json`` and (optionally) ``--plot``."""
    parser.add_argument("--out", default=None, metavar="FILE", help="write the plan JSON here")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out/--plot")
    parser.add_argument("--json", action="store_true", help="print only the plan JSON on stdout")
    if plot:
        parser.add_argument(
            "--plot", default=None, metavar="PNG", help="pipeline schedule and memory plot"
        )


def split_gpu_count(num_gpus: int, gpus_per_node: int = GPUS_PER_NODE,
                    named: str = "--gpus") -> tuple[int, int]:
    """Nodes and GPUs a node for ``--gpus N``: ``(ceil(N / 8), min(N, 8))``.

    Raises:
        ClusterConfigError: N < 1, or N > 8 and not a multiple of 8.
    """
    if num_gpus < 1:
        raise ClusterConfigError(f"--gpus must be at least 1, got {num_gpus}")
    if num_gpus > gpus_per_node and num_gpus % gpus_per_node:
        lower = num_gpus // gpus_per_node * gpus_per_node
        fix = (f"use {lower} or {lower + gpus_per_node}" if named == "--gpus" else
               f"pick degrees whose product is at most {gpus_per_node} or a multiple of it")
        raise ClusterConfigError(
            f"{named} {num_gpus} does not fill nodes of {gpus_per_node} GPUs; {fix}, or "
            "describe the machines with --cluster FILE"
        )
    nodes = -(-num_gpus // gpus_per_node)
    return nodes, min(num_gpus, gpus_per_node)


def cluster_from_args(args: argparse.Namespace, *, default_gpus: int | None = None) -> Any:
    """The Cluster the arguments describe.

    Args:
        args: parsed arguments with the fields of ``add_cluster_arguments``.
        default_gpus: GPU count to use when neither --gpus, --nodes nor --cluster is given.

    Raises:
        ClusterConfigError: conflicting or missing cluster arguments.
    """
    from autopar.cost_model.hardware import Cluster

    if args.cluster:
        if args.gpus or args.nodes or args.gpu:
            raise ClusterConfigError(
                "--cluster already describes the machines; drop --gpus/--nodes/--gpu"
            )
        if not Path(args.cluster).is_file():
            what = _not_a_file(Path(args.cluster))
            raise ClusterConfigError(f"cluster file {args.cluster} {what}; give a cluster YAML "
                                     "file (`autopar calibrate` writes one)")
        cluster = Cluster.from_yaml(args.cluster)
        if args.gpu_memory:
            raise ClusterConfigError("set the memory in the cluster file, not with --gpu-memory")
        return cluster
    gpu = args.gpu or DEFAULT_GPU
    gpus = args.gpus if args.gpus is not None else default_gpus
    if args.nodes is not None:
        if args.nodes < 1:
            raise ClusterConfigError(f"--nodes must be at least 1, got {args.nodes}")
        nodes, per_node = args.nodes, GPUS_PER_NODE
    elif gpus is not None:  # the split's own GPU count where --gpus is not given
        named = "--gpus" if args.gpus is not None else "the split's GPUs (dp*cp*tp*pp)"
        nodes, per_node = split_gpu_count(gpus, named=named)
    else:
        raise ClusterConfigError("say how many GPUs: --gpus N, --nodes N or --cluster FILE")
    return Cluster.preset(gpu, nodes=nodes, gpus_per_node=per_node, gpu_memory_gb=args.gpu_memory)


def load_profile(model_text: str, seq_len: int | None, *, timeout_s: float | None = None,
                 loss: str = "eager", framework: str | None = None) -> Any:
    """Resolve MODEL, build it on the meta device and profile it, within ``timeout_s``.

    Args:
        model_text: the MODEL argument (model file, zoo name or spec, HF config JSON).
        seq_len: tokens per sequence (None: the model's own, from its spec or HF config).
        timeout_s: wall-clock limit on building and profiling (None: none); see
            ``autopar.timelimit`` for how a model file's code is stopped.
        loss: the token cross-entropy kernel (``autopar.profile``'s ``loss``).
        framework: the framework the profile is planned for: one that runs the traced modules
            (autopar's runtime) trains on their logits, so a forward that returns logits for
            fewer positions than the LM loss needs is refused, as ``autopar run`` refuses it,
            instead of warned about.

    Returns:
        The ModelProfile.

    Raises:
        AutoparError: the model cannot be found, built or traced, or the limit ran out.
    """
    load_profiler()  # before the clock starts: an alarm never lands inside torch's import
    from autopar.cost_model.frameworks import get_framework
    from autopar.graph.model_text import build_and_profile
    from autopar.graph.profiler import short_logits_refused
    from autopar.timelimit import time_limit

    traced = framework is not None and get_framework(framework).runs_traced_modules
    fix = "raise --build-timeout (and --time-budget), or fix the model's build_model()"
    with time_limit(timeout_s, f"building and profiling {model_text}", fix,
                    hard_exit_after_s=HARD_EXIT_GRACE_S), (
            short_logits_refused() if traced else contextlib.nullcontext()):
        profile = build_and_profile(model_text, seq_len=seq_len, loss=loss)[1]
    from autopar.models.resolve import model_notes

    for note in model_notes(model_text):
        print(f"autopar: note: {note}", file=sys.stderr)
    return profile


def load_profiler() -> None:
    """Import torch, the tracer and the zoo (a second or more): a build's time limit bounds
    the model's own build and profile, not this; a command's --time-budget counts it when its
    clock starts before this call."""
    import autopar.graph.profiler
    import autopar.models.zoo  # noqa: F401


def _not_a_file(path: Path) -> str:
    """Why ``path``, which is no regular file, cannot be read as one."""
    if path.is_dir():
        return "is a directory"
    return "is not a regular file" if path.exists() else "does not exist"


# Seconds past --build-timeout after which a model build that ignores the alarm ends the command.
HARD_EXIT_GRACE_S = 5.0


def load_plan_file(path: str) -> Any:
    """Read a plan JSON file (``PlanFormatError`` / ``AutoparError`` on a bad file)."""
    from autopar.json_data import read_text
    from autopar.plan import Plan

    file = Path(path)
    if not file.is_file():
        what = _not_a_file(file)
        raise AutoparError(f"plan file {path} {what}; give a plan JSON file (`autopar plan "
                           "--out`)")
    where = f"plan file {path}"
    text = read_text(file, where, "a plan JSON file (`autopar plan --out`)")
    return Plan.from_json(text, where)


def make_console(*, stderr: bool) -> Any:
    """A rich Console on stderr or stdout (wide enough for the tables when not a terminal)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 120

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich's own handler exits 1; main() ends with 0
            raise BrokenPipeError("stdout was closed")

    return _Console(file=stream, width=width, highlight=False)


@contextlib.contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int, str], None]]:
    """A rich progress bar on a terminal stderr, fed by ``progress(done, total, message)``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = make_console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[message]}"))
    # none where stderr is not a terminal: its last refresh left a blank line before errors
    with Progress(*columns, console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task(description, total=None, message="")

        def update(done: int, total: int, message: str) -> None:
            progress.update(task, completed=done, total=max(total, 1), message=message[:60])

        yield update


def describe_cluster(cluster: Any) -> str:
    """``16 x 8 a100-80g (128 GPUs, 76.0 GiB usable each)``."""
    from autopar.units import format_bytes

    return (
        f"{cluster.nodes} x {cluster.gpus_per_node} {cluster.name} ({cluster.num_gpus} GPUs, "
        f"{format_bytes(cluster.usable_memory_bytes)} usable each)"
    )


def print_plan_report(
    plan: Any, cluster: Any | None, *, alternatives: Any = (), stderr: bool = False
) -> None:
    """The full report of a Plan on stdout (or stderr)."""
    from autopar.report import render_report

    where = describe_cluster(cluster) if cluster is not None else _cluster_text(plan.cluster)
    title = f"{plan.model or 'model'} on {where}"
    render_report(
        make_console(stderr=stderr),
        plan.config,
        plan.estimate,
        title=title,
        plan=plan,
        alternatives=alternatives,
        gpus_per_node=(
            cluster.gpus_per_node if cluster is not None else plan.cluster.get("gpus_per_node")
        ),
    )


def _cluster_text(cluster: dict[str, Any]) -> str:
    if not cluster:
        return "an unrecorded cluster"
    return f"{cluster.get('nodes')} x {cluster.get('gpus_per_node')} {cluster.get('name')}"


def check_outputs(args: argparse.Namespace) -> None:
    """Fail early (before any work) when ``--out``/``--plot`` cannot be written, coincide, or
    name a file the command reads (the model file, the cluster file)."""
    out, plot = getattr(args, "out", None), getattr(args, "plot", None)
    if out and plot and Path(out).resolve() == Path(plot).resolve():
        raise AutoparError(f"--out and --plot both name {out}; give two different files")
    reads = tuple(p for p in (getattr(args, "model", None), getattr(args, "cluster", None))
                  if isinstance(p, str) and Path(p).is_file())
    check_writable(out, force=args.force, reads=reads)
    check_plot_path(plot, force=args.force, reads=reads)


def save_outputs(plan: Any, args: argparse.Namespace) -> None:
    """Write ``--out`` (plan JSON) and ``--plot`` (PNG) when asked; say so on stderr.

    Both documents are made before either is written, and written together or not at all
    (``write_outputs``): on error the user's files are as they were.
    """
    files: list[tuple[str, str | bytes]] = []
    if getattr(args, "out", None):
        files.append((args.out, plan.to_json()))
    if getattr(args, "plot", None):
        from autopar.plotting import plot_plan

        png = plot_plan(plan.config, plan.estimate, title=f"{plan.model}: {plan.config.describe()}")
        files.append((args.plot, png))
    write_outputs(files, force=args.force)
    for path, _data in files:
        print(f"autopar: wrote {path}", file=sys.stderr)


class Budget:
    """``--time-budget`` over the whole command: what is left for each step."""

    def __init__(self, total_s: float | None) -> None:
        self.total_s = total_s
        self._start = time.monotonic()

    def remaining_s(self) -> float | None:
        """Seconds left (None: no budget)."""
        if self.total_s is None:
            return None
        return self.total_s - (time.monotonic() - self._start)

    def limit(self, other_s: float | None) -> float | None:
        """The smaller of ``other_s`` and what is left (None when both are unbounded)."""
        left = self.remaining_s()
        return other_s if left is None else left if other_s is None else min(other_s, left)

    def left(self, doing: str) -> float | None:
        """Seconds left for ``doing``; ``AutoparError`` when none are."""
        left = self.remaining_s()
        if left is not None and left <= 0:
            raise AutoparError(
                f"--time-budget {self.total_s:g} s ran out before {doing}; allow more time"
            )
        return left


def plan_context(plan: Any, model_text: str | None, seq_len: int | None, *,
                 timeout_s: float | None = None) -> tuple[Any, Any]:
    """Rebuild the profile and the Cluster a plan was made for, checking both fingerprints.

    Args:
        plan: the Plan.
        model_text: MODEL to use instead of ``plan.model``.
        seq_len: tokens per sequence (None: the model's own).
        timeout_s: wall-clock limit on building and profiling the model (None: none).

    Raises:
        PlanMismatchError: the model or the cluster is not the one the plan was made for.
        AutoparError: the plan records no model and none was given, or it names a model file
            (code) and none was given.
    """
    from autopar.cost_model.hardware import Cluster
    from autopar.errors import PlanMismatchError
    from autopar.graph.model_text import plan_model_text

    text = plan_model_text(plan.model, model_text)
    profile = load_profile(text, seq_len or plan.seq_len or None, loss=plan.loss,
                           timeout_s=timeout_s)
    plan.check_profile(profile, fix=(
        f"{text} is not it: pass the model the plan was made for with --model (and --seq-len), "
        "or re-plan with `autopar plan`" if model_text or seq_len else
        f"the plan's own model {text} profiles differently now (a plan from another autopar "
        "version?): re-plan it with `autopar plan`"))
    if not plan.cluster:
        raise AutoparError("the plan does not record its cluster; re-create it with autopar plan")
    cluster = Cluster.from_dict(plan.cluster)
    if plan.cluster_fingerprint and cluster.fingerprint() != plan.cluster_fingerprint:
        raise PlanMismatchError(
            "the plan's cluster section does not match its cluster fingerprint (the file was "
            "edited); re-plan with `autopar plan`"
        )
    return profile, cluster
