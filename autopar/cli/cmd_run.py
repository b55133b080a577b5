"""``autopar run``: train a plan (or a given split of a model) with torchrun and report what it did.

``add_run_arguments(parser)`` declares the command's arguments and ``run_command(args)`` runs it;
``main(argv)`` runs the same thing without the rest of the CLI. A bare split becomes a Plan here
(``search.plan_from_config``): the runtime receives Plans only. Everything a user can get
wrong (a world size that does not match the launch, a plan for another model, checkpoint
directories) is checked here, before any worker starts, and ends with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.cli import common
from autopar.cli.argtypes import MAX_RESTARTS, MAX_SEED, MAX_STEPS, int_in
from autopar.cli.split_args import add_split_arguments
from autopar.config import MAX_SEQ_LEN
from autopar.cost_model.hardware import MAX_GPUS
from autopar.errors import AutoparError
from autopar.stdio import document_stdout
from autopar.units import MIB

__all__ = ["HELP", "NAME", "ORDER", "add_arguments", "add_run_arguments", "main", "run",
           "run_command"]

NAME = "run"
HELP = "train a plan (or a given split of a model) on synthetic data and report what it did"
ORDER = 80



def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the arguments of ``autopar run`` on ``parser``."""
    parser.add_argument(
        "source", metavar="PLAN_OR_MODEL", type=common.model_name,
        help="a plan JSON file (brings its split and global batch), or a model: "
        "gpt:layers=4,hidden=64,heads=4,vocab=256,seq_len=32, a zoo preset, a .py model file, "
        "an HF config JSON",
    )
    parser.add_argument("--model", default=None, type=common.model_name,
                        help="with a plan: the model to run (default: the plan's model field; "
                        "a .py model file runs only when named here)")
    split = parser.add_argument_group("split (with a model; a plan brings its own)")
    add_split_arguments(split, for_run=True)
    split.add_argument("--seq-len", type=int_in(1, MAX_SEQ_LEN), default=None,
                       help="tokens per sequence (default: the model's; a Hugging Face config "
                       "without max_position_embeddings needs it)")
    parser.add_argument("--steps", type=int_in(1, MAX_STEPS), required=True,
                        help="total optimizer steps (with --resume: continue up to this step)")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                        help="seed of weights and data")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ckpt = parser.add_argument_group("checkpoints and faults")
    ckpt.add_argument("--checkpoint-dir", default=None, metavar="DIR")
    ckpt.add_argument("--checkpoint-every", type=int_in(0, MAX_STEPS), default=0, metavar="K",
                      help="checkpoint every K steps (and after the last)")
    ckpt.add_argument("--resume", action="store_true",
                      help="continue from the newest checkpoint in --checkpoint-dir whose "
                      "manifest verifies")
    ckpt.add_argument("--trust-checkpoint", action="store_true",
                      help="with --resume: also load a checkpoint autopar did not write (no "
                      "manifest), unverified (still as data: no checkpoint runs code)")
    ckpt.add_argument("--max-restarts", type=int_in(0, MAX_RESTARTS), default=0,
                      help="torchrun restarts after a worker fails (resumes from the checkpoint)")
    nodes = parser.add_argument_group("multi-node (passed to torchrun; same command on every node)")
    nodes.add_argument("--nnodes", type=int_in(1, MAX_GPUS), default=1)
    nodes.add_argument("--node-rank", type=int_in(0, MAX_GPUS - 1), default=0)
    nodes.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT")
    nodes.add_argument("--nproc-per-node", type=int_in(1, MAX_GPUS), default=None,
                       help="workers on this node (default: world size / nnodes)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the plan at full world size on a fake process group")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``run``'s arguments."""
    add_run_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run ``autopar run`` (see ``run_command``)."""
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Run ``autopar run`` for parsed arguments; returns the exit code (2 for bad input)."""
    with document_stdout() as write:
        try:
            return _run(args, write)
        except (AutoparError, ValueError) as err:
            # Every user error is one line; ValueError covers ParallelConfig's own checks.
            text = " ".join(str(err).split()) or type(err).__name__
            print(f"autopar: error: {text}", file=sys.stderr)
            return 2


def _run(args: argparse.Namespace, write: Callable[[str], None]) -> int:
    from autopar.runtime.checkpoint import check_checkpoint_dir, model_problem
    from autopar.runtime.launch import launch

    job = _resolve_job(args)
    # The checkpoint flags are the run's too: a dry run checks them as well.
    point = check_checkpoint_dir(
        args.checkpoint_dir, resume=args.resume, steps=args.steps, every=args.checkpoint_every,
        trust=args.trust_checkpoint,
    )
    problem = (model_problem(args.checkpoint_dir, point.step, job.state_shapes)
               if point.step is not None else None)
    if problem:
        raise AutoparError(problem)
    if args.dry_run:
        from autopar.runtime.dry_run import dry_run, format_report

        report = dry_run(job.plan, job.model_text)
        _emit(write, args.json, report.to_dict(), format_report(report))
        return 0
    spec = _launch_spec(args, job.plan.config.world_size)
    if point.note():
        print(f"autopar: note: {point.note()}", file=sys.stderr)
    start = point.step or 0
    result = launch(_worker_args(args, job), spec)
    if result.returncode != 0 or not result.finished:
        print(f"autopar run: the workers failed (torchrun exit code {result.returncode}); "
              "see the log above", file=sys.stderr)
        return 1
    record = {
        "losses": list(result.losses),
        "step_times_s": list(result.step_times_s),
        "peak_memory_bytes": result.peak_memory_bytes,
        "peak_memory_bytes_per_rank": list(result.peak_memory_bytes_per_rank),
        "world_size": result.world_size,
        "config": job.plan.config.to_dict(),
        "steps": list(result.steps),
        "first_step": start + 1,
    }
    _emit(write, args.json, record, _format_result(record, job.plan))
    return 0


@dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    """What to run: the plan, how to rebuild its model, and the synthetic data's shape."""

    plan: Any
    model_text: str
    seq_len: int
    vocab: int
    state_shapes: dict[str, tuple[int, ...]]


_SPLIT_FLAGS = ("dp", "cp", "tp", "pp", "ep", "dp_replicate", "offload", "schedule",
                "virtual_stages", "micro_batch", "zero", "recompute", "sequence_parallel", "dtype",
                "global_batch", "seq_len")


def _read_plan_doc(source: str) -> dict[str, Any] | None:
    """The plan document if ``source`` is a plan JSON file (has ``schema_version``), whatever
    its name (as show and export read it), else None. A plan's numbers are read as the other
    commands read them: NaN and Infinity refused."""
    from autopar.json_data import parse_json, read_text
    from autopar.plan import PlanFormatError, reject_constant

    path = Path(source)
    if path.suffix.lower() == ".py" or not path.is_file():
        return None
    text = read_text(path, source, "a plan JSON or a model")
    if path.suffix.lower() != ".json" and not text.lstrip().startswith("{"):
        return None  # not a JSON object: a model text's business
    constants: list[str] = []  # NaN / Infinity: a model config's reader judges its own

    def noted(name: str) -> float:
        constants.append(name)
        return float(name)

    data = parse_json(text, source, "a plan JSON or a model", PlanFormatError,
                      parse_constant=noted)
    if not (isinstance(data, dict) and "schema_version" in data):
        return None
    if constants:
        reject_constant(constants[0])  # no plan's number is
    return data


def _resolve_job(args: argparse.Namespace) -> _Job:
    from autopar.plan import Plan

    doc = _read_plan_doc(args.source)
    if doc is not None:
        given = [f"--{f.replace('_', '-')}" for f in _SPLIT_FLAGS if getattr(args, f) is not None]
        if given:
            raise AutoparError(
                f"{args.source} is a plan and brings its own split and global batch; drop "
                f"{' '.join(given)} (or run the model with the split you want)"
            )
        from autopar.graph.model_text import plan_model_text

        plan = Plan.from_dict(doc)
        model_text = plan_model_text(plan.model, args.model)
        model, profile = _build_and_profile(model_text, plan.seq_len or None)
        plan.check_profile(profile, fix=(
            f"--model {model_text} is not the model plan {args.source} was made for: pass that "
            "one, or re-plan with `autopar plan` for this model" if args.model else
            f"plan {args.source}'s own model {model_text} profiles differently now (a plan "
            "from another autopar version?): re-plan it with `autopar plan`"))
    else:
        if args.model:
            raise AutoparError("--model goes with a plan file; give the model as PLAN_OR_MODEL")
        model_text = args.source
        from autopar.search.planner import plan_from_config

        config = _config_from_args(args)
        # The launch geometry first: the estimate's cluster is the nodes this run occupies.
        spec = _launch_spec(args, config.world_size)
        model, profile = _build_and_profile(model_text, args.seq_len)
        cluster = _local_cluster(spec.nnodes, spec.nproc_per_node)
        plan = plan_from_config(profile, cluster, config, model=model_text)
    from autopar.runtime.apply import check_plan_runnable
    from autopar.runtime.worker import pipeline_batch_problem

    # Everything the runtime would reject, before any process starts.
    check_plan_runnable(model, plan)
    problem = pipeline_batch_problem(model_text, profile, plan.config.pp)
    if problem:
        raise AutoparError(problem)
    return _Job(plan=plan, model_text=model_text, seq_len=profile.seq_len, vocab=profile.vocab,
                state_shapes={k: tuple(v.shape) for k, v in model.state_dict().items()})


def _build_and_profile(model_text: str, seq_len: int | None = None) -> tuple[Any, Any]:
    """Build ``model_text`` on the meta device and profile it as ``autopar plan`` does; a
    forward whose logits miss positions the LM loss needs is refused before any launch."""
    from autopar.graph.model_text import build_and_profile
    from autopar.graph.profiler import short_logits_refused

    with short_logits_refused():
        return build_and_profile(model_text, seq_len=seq_len)


def _launch_spec(args: argparse.Namespace, world_size: int) -> Any:
    from autopar.runtime.launch import launch_spec_for

    return launch_spec_for(
        world_size=world_size, nnodes=args.nnodes, node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint, nproc_per_node=args.nproc_per_node,
        max_restarts=args.max_restarts,
    )


def _local_cluster(nnodes: int, per_node: int) -> Any:
    """The Cluster a bare split is estimated on: this machine's kind of device, as launched."""
    import torch

    from autopar.cost_model.hardware import Cluster
    from autopar.cost_model.presets import preset_for_device_name

    if not torch.cuda.is_available():
        return Cluster.preset("cpu", nodes=nnodes, gpus_per_node=per_node)
    preset = preset_for_device_name(torch.cuda.get_device_name())
    return Cluster.preset(preset, nodes=nnodes, gpus_per_node=per_node)


def _config_from_args(args: argparse.Namespace) -> Any:
    from autopar.config import ParallelConfig
    from autopar.schedules import DEFAULT_SCHEDULE, SCHEDULES, get_schedule

    if args.global_batch is None:
        raise AutoparError("give --global-batch B (sequences per step) to run a model")
    # A split flag not given takes ParallelConfig's own default; these four are set here.
    apart = ("virtual_stages", "dtype", "global_batch", "seq_len")
    given = {name: getattr(args, name) for name in _SPLIT_FLAGS
             if name not in apart and getattr(args, name) is not None}
    virtual = args.virtual_stages
    schedule = given.get("schedule", DEFAULT_SCHEDULE)
    if virtual is None and schedule in SCHEDULES:  # an unknown one is ParallelConfig's to name
        virtual = get_schedule(schedule).default_virtual_stages(given.get("pp", 1))
    if virtual is not None:
        given["virtual_stages"] = virtual
    return ParallelConfig(global_batch=args.global_batch, dtype=args.dtype or _default_dtype(),
                          **given)


def _default_dtype() -> str:
    import torch

    from autopar.runtime.mesh import default_dtype

    return default_dtype("cuda" if torch.cuda.is_available() else "cpu")


def _worker_args(args: argparse.Namespace, job: _Job) -> Any:
    import torch

    from autopar.runtime.launch import PG_TIMEOUT_S
    from autopar.runtime.worker import WorkerArgs

    return WorkerArgs(
        plan=job.plan.to_dict(), model=job.model_text, steps=args.steps, seed=args.seed,
        checkpoint_dir=str(Path(args.checkpoint_dir).resolve()) if args.checkpoint_dir else "",
        checkpoint_every=args.checkpoint_every, seq_len=job.seq_len, vocab=job.vocab,
        result_path="", device_type="cuda" if torch.cuda.is_available() else "cpu",
        pg_timeout_s=PG_TIMEOUT_S, trust_checkpoint=args.trust_checkpoint,
    )


def _emit(write: Callable[[str], None], as_json: bool, record: dict[str, Any], text: str
          ) -> None:
    write(json.dumps(record, sort_keys=True) + "\n" if as_json else text)


def _format_result(record: dict[str, Any], plan: Any) -> str:
    lines = [f"autopar run: {plan.config.describe()} on {record['world_size']} process(es)"]
    for step, loss, t in zip(record["steps"], record["losses"], record["step_times_s"]):
        lines.append(f"  step {step:5d}  loss {loss:.6f}  time {t * 1e3:9.2f} ms")
    peak_mib = record["peak_memory_bytes"] / MIB
    lines.append(f"  peak memory (largest rank): {peak_mib:.2f} MiB")
    est = plan.estimate
    if est.step_time_s > 0:
        lines.append(
            f"  predicted: step {est.step_time_s * 1e3:.2f} ms, memory "
            f"{est.memory_per_gpu_bytes / MIB:.2f} MiB per GPU (on the plan's cluster)"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``autopar run PLAN_OR_MODEL ...`` without the rest of the command line."""
    parser = argparse.ArgumentParser(prog="autopar run", description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    return run_command(parser.parse_args(argv))


