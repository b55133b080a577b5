"""Runtime overhead: autopar's runtime against the same split composed by hand in torch.

For each split of a small zoo GPT, every rank builds the model twice from one seed and trains both
copies on the same global batches with AdamW:

* **autopar**: the path of ``autopar run``'s worker (``autopar.runtime.worker``): ``apply_plan``
  on the plan ``autopar run`` makes for the split (``plan_from_config``), one AdamW per model part,
  ``train_step`` on ``local_batch`` rows, and the live-tensor counter over the build and the
  first ``TRACKED_STEPS`` steps, as the worker keeps it on CPU;
* **hand**: the same split written directly against torch, no autopar runtime code:
  ``DistributedDataParallel`` with ``no_sync``, ``fully_shard`` per block and root,
  ``parallelize_module`` with the Megatron layout autopar uses (vocab-parallel embedding, q/k/v and
  MLP up colwise, wo and MLP down rowwise, logits sharded over the vocabulary and the loss in
  torch's ``loss_parallel()``, torchtitan's way; norms ``SequenceParallel`` with SP),
  ``PipelineStage`` on a pruned deep copy per stage plus torch's schedule class, one AdamW.

Both report the global mean loss (one float all-reduced over the world). Steps alternate A B B A
A B ... so drift and "who runs first" cancel; every step starts after a barrier and its time is
the slowest rank's, measured with torch's own timer (``torch.utils.benchmark.utils.timer.timer``,
which synchronises CUDA). The ratio is autopar's speed over the hand-composed speed, taken as the
median over steps of the paired ``hand_ms / autopar_ms`` (target >= 0.97). The process CPU time
per step is reported beside it: on a shared machine it moves less with other jobs' load than wall
time does, and Python overhead (hooks, extra calls) shows in it directly. The losses of the two
paths must agree (else the comparison is not of the same computation).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime_overhead.py`` (CPU, gloo, fp32);
``--device cuda`` runs NCCL with one GPU per rank; ``--out FILE.md`` writes the results table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any

MODEL_TEXT = "gpt:layers=4,hidden=128,heads=4,vocab=512,seq_len=64"
GLOBAL_BATCH = 8
SEED = 0
TARGET = 0.97
# Two losses of the same computation agree to float rounding; AdamW amplifies rounding to ~1e-4
# after a few steps (docs/runtime.md), so 1e-3 relative separates "same split" from "different".
LOSS_RTOL = 1e-3


@dataclass(frozen=True, slots=True)
class Split:
    """One split to compare: its name and ``ParallelConfig`` fields (fp32)."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """Processes the split runs on."""
        cfg = self.config
        return cfg.get("dp", 1) * cfg.get("tp", 1) * cfg.get("pp", 1)


SPLITS: tuple[Split, ...] = (
    Split("one process", {"micro_batch": 2}),
    Split("ddp dp=2", {"dp": 2, "micro_batch": 2}),
    Split("fsdp2 zero3 dp=2", {"dp": 2, "zero": 3, "micro_batch": 2}),
    Split("tp=2", {"tp": 2, "micro_batch": 4}),
    Split("tp=2 +sp", {"tp": 2, "sequence_parallel": True, "micro_batch": 4}),
    Split("pp=2 1f1b", {"pp": 2, "schedule": "1f1b", "micro_batch": 2}),
    Split("pp=2 interleaved v=2", {
        "pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batch": 2,
    }),
    Split("dp=2 x tp=2 fsdp2 zero3", {"dp": 2, "tp": 2, "zero": 3, "micro_batch": 2}),
)


def make_plan(split: Split, model_text: str = MODEL_TEXT, global_batch: int = GLOBAL_BATCH,
              device_type: str = "cpu", dtype: str = "fp32") -> Any:
    """The plan ``autopar run MODEL --dp .. --tp .. --pp ..`` makes for ``split``."""
    from autopar.config import ParallelConfig
    from autopar.cost_model.hardware import Cluster
    from autopar.graph.model_text import build_and_profile
    from autopar.search.planner import plan_from_config

    config = ParallelConfig(global_batch=global_batch, dtype=dtype, **split.config)
    _, profile = build_and_profile(model_text)
    preset = "cpu" if device_type == "cpu" else "h100"
    cluster = Cluster.preset(preset, nodes=1, gpus_per_node=split.world_size)
    return plan_from_config(profile, cluster, config, model=model_text)


# ---------------------------------------------------------------------------------------------
# (a) autopar: the worker's own path


def build_autopar(plan_dict: dict[str, Any], model_text: str, device: Any) -> Callable[..., float]:
    """``autopar run``'s job for this rank: returns ``step(batch, tracked) -> loss``."""
    from autopar.runtime import worker

    seq_len, vocab = _seq_vocab(model_text)
    args = worker.WorkerArgs(
        plan=plan_dict, model=model_text, steps=0, seed=SEED, checkpoint_dir="",
        checkpoint_every=0, seq_len=seq_len, vocab=vocab, result_path="",
        device_type=device.type, pg_timeout_s=0.0,
    )
    tracker = worker.LiveTensorBytes() if device.type == "cpu" else None
    with tracker if tracker is not None else contextlib.nullcontext():
        job = worker._build_job(args, device)
        optimizers = worker._Optimizers(job.model_parts)

    def step(batch: Any, index: int, tracked: bool) -> float:
        # The worker draws step ``index``'s batch itself (the same synthetic_batch(SEED, index)
        # the hand path is given).
        with tracker if tracker is not None and tracked else contextlib.nullcontext():
            return job.step(index, optimizers)

    return step


# ---------------------------------------------------------------------------------------------
# (b) hand: the same split with torch's APIs only


def _lm_loss(logits: Any, labels: Any) -> Any:
    import torch.nn.functional as F

    # In fp32 (torchtitan's cross_entropy_loss upcasts 16-bit logits too).
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _tp_plan(model: Any, sp: bool) -> dict[str, Any]:
    # The Megatron layout autopar's default tp_layout names, written out for the zoo GPT.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    act = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    for key in model.layers:
        block = f"layers.{key}"
        for sub, cols, row in (("attention", ("wq", "wk", "wv"), "wo"),
                               ("feed_forward", ("w1",), "w2")):
            plan[f"{block}.{sub}"] = PrepareModuleInput(
                input_layouts=(act,), desired_input_layouts=(Replicate(),))
            plan.update({f"{block}.{sub}.{c}": ColwiseParallel() for c in cols})
            plan[f"{block}.{sub}.{row}"] = RowwiseParallel(output_layouts=act)
        if sp:
            plan[f"{block}.attention_norm"] = SequenceParallel()
            plan[f"{block}.ffn_norm"] = SequenceParallel()
    if sp and model.norm is not None:
        plan["norm"] = SequenceParallel()
    if sp and "0" in model.layers:  # the first block cuts the embedding to the sequence shard
        plan["layers.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1),
                                         use_local_output=False)
    return plan


def _hand_stage(model: Any, layers: tuple[int, int], num_blocks: int) -> Any:
    # torchtitan's way: a deep copy of the model with what the stage does not own removed.
    first, last = layers
    stage = copy.deepcopy(model)
    if first > 0:
        stage.tok_embeddings, stage.pos_embeddings = None, None
    if last < num_blocks + 1:
        stage.norm, stage.output = None, None
    for key in list(stage.layers.keys()):
        if not first <= int(key) + 1 <= last:
            del stage.layers[key]
    return stage


def _shard_parts(parts: list[Any], cfg: dict[str, Any], mesh: Any) -> list[Any]:
    # TP, then DP, per part (torchtitan's order).
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    out = []
    for part in parts:
        if cfg.get("tp", 1) > 1:
            sp = cfg.get("sequence_parallel", False)
            parallelize_module(part, mesh["tp"], _tp_plan(part, sp))
        if cfg.get("dp", 1) > 1 and cfg.get("zero", 0) == 3:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            dtype = _autocast_dtype(cfg)
            mp = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype
                  else MixedPrecisionPolicy())
            for block in part.layers.values():
                fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
            fully_shard(part, mesh=mesh["dp"], mp_policy=mp)
        elif cfg.get("dp", 1) > 1:
            part = DistributedDataParallel(part)
        out.append(part)
    return out


def build_hand(cfg: dict[str, Any], stage_layers: list[tuple[int, int]], model_text: str,
               device: Any) -> Callable[..., float]:
    """The split composed by hand: returns ``step(batch, tracked) -> loss``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.models import build
    from autopar.models.resolve import parse_model_spec

    kind, shape = parse_model_spec(model_text)
    model = build(kind, device=device, seed=SEED, **shape)
    dp, tp, pp = cfg.get("dp", 1), cfg.get("tp", 1), cfg.get("pp", 1)
    dims = [(n, d) for n, d in (("dp", dp), ("tp", tp)) if d > 1]
    mesh = None
    if dims and pp == 1:
        mesh = init_device_mesh(device.type, tuple(d for _, d in dims),
                                mesh_dim_names=tuple(n for n, _ in dims))
    n_mb = GLOBAL_BATCH // (dp * cfg.get("micro_batch", 1))
    rank = dist.get_rank()
    schedule, last_stage = None, False
    if pp == 1:
        parts = _shard_parts([model], cfg, mesh)
    else:
        mine = [s for s in range(len(stage_layers)) if s % pp == rank]
        parts = [_hand_stage(model, stage_layers[s], shape["layers"]) for s in mine]
        stages = [pipelining.PipelineStage(p, s, len(stage_layers), device)
                  for p, s in zip(parts, mine)]
        cls = getattr(pipelining, {"1f1b": "Schedule1F1B",
                                   "interleaved-1f1b": "ScheduleInterleaved1F1B"}[cfg["schedule"]])
        schedule = cls(stages if len(stages) > 1 else stages[0], n_microbatches=n_mb,
                       loss_fn=_lm_loss)
        last_stage = len(stage_layers) - 1 in mine
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    dp_rank = rank // tp % dp if pp == 1 else 0
    # 16-bit compute: FSDP2's MixedPrecisionPolicy (above), else autocast, as in any torch loop.
    autocast = None if cfg.get("zero", 0) == 3 and dp > 1 else _autocast_dtype(cfg)

    from autopar.runtime.data import synthetic_batch

    seq_len, vocab = _seq_vocab(model_text)

    def step(batch: Any, index: int, tracked: bool) -> float:
        # Drawn inside the timed step, as autopar's worker draws it (``batch`` is the same one).
        batch = synthetic_batch(seed=SEED, step=index, batch=GLOBAL_BATCH, seq_len=seq_len,
                                vocab=vocab)
        for p in params:
            p.grad = None
        tokens = batch.tokens.to(device).chunk(dp)[dp_rank]
        labels = batch.labels.to(device).chunk(dp)[dp_rank]
        if schedule is None:
            with _vocab_parallel(tp):
                local = _accumulate(parts[0], tokens, labels, n_mb, autocast)
        else:
            with _autocast(autocast, device):
                local = _pipeline_step(schedule, rank, last_stage, tokens, labels)
        optimizer.step()
        value = torch.tensor([local], dtype=torch.float64, device=device)
        dist.all_reduce(value)
        return float(value.item()) / (dp * tp)

    return step


def _vocab_parallel(tp: int) -> Any:
    # The cross entropy of vocab-sharded logits (torch's loss_parallel) when tp > 1.
    if tp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _autocast_dtype(cfg: dict[str, Any]) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.get("dtype", "fp32"))


def _autocast(dtype: Any, device: Any) -> Any:
    import torch

    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _accumulate(model: Any, tokens: Any, labels: Any, n_mb: int, autocast: Any) -> float:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    total = torch.zeros((), dtype=torch.float64, device=tokens.device)
    for i, (x, y) in enumerate(zip(tokens.chunk(n_mb), labels.chunk(n_mb))):
        last = i == n_mb - 1
        sync = (model.no_sync() if isinstance(model, DistributedDataParallel) and not last
                else contextlib.nullcontext())
        with sync:
            with _autocast(autocast, tokens.device):
                logits = model(x)
            loss = _lm_loss(logits, y)
            (loss / n_mb).backward()
        total += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
    return float(total) / n_mb


def _pipeline_step(schedule: Any, rank: int, last: bool, tokens: Any, labels: Any) -> float:
    import torch

    losses: list[Any] = []
    if rank == 0:
        schedule.step(tokens)
    elif last:
        schedule.step(target=labels, losses=losses)
    else:
        schedule.step()
    return float(torch.stack(losses).detach().mean()) if losses else 0.0


# ---------------------------------------------------------------------------------------------
# The paired measurement (one spawned process per rank)


def bench_split(rank: int, world_size: int, split: Split, plan_dict: dict[str, Any],
                model_text: str, warmup: int, steps: int) -> dict[str, Any]:
    """Build both paths, run them interleaved; every rank returns the same summary."""
    import torch
    import torch.distributed as dist
    from torch.utils.benchmark.utils.timer import timer

    from autopar.runtime.data import synthetic_batch
    from autopar.runtime.worker import TRACKED_STEPS

    if warmup < TRACKED_STEPS:
        raise ValueError(f"warmup must cover the worker's {TRACKED_STEPS} tracked steps")
    device = _rank_device(rank)
    layers = [tuple(s["layers"]) for s in plan_dict["stages"]]
    runners = {"autopar": build_autopar(plan_dict, model_text, device),
               "hand": build_hand({**split.config, "dtype": plan_dict["config"]["dtype"]},
                                  layers, model_text, device)}
    seq_len, vocab = _seq_vocab(model_text)
    times: dict[str, list[float]] = {"autopar": [], "hand": [], "autopar_cpu": [], "hand_cpu": []}
    losses: dict[str, list[float]] = {"autopar": [], "hand": []}
    for k in range(1, warmup + steps + 1):
        batch = synthetic_batch(seed=SEED, step=k, batch=GLOBAL_BATCH, seq_len=seq_len,
                                vocab=vocab)
        order = ("autopar", "hand") if k % 2 else ("hand", "autopar")
        for name in order:
            dist.barrier()
            start, cpu = timer(), time.process_time()
            losses[name].append(runners[name](batch, k, k <= TRACKED_STEPS))
            times[name].append(timer() - start)
            times[f"{name}_cpu"].append(time.process_time() - cpu)
    # The slowest rank's time of each step (wall, and CPU time of the rank's process).
    # On the ranks' device: NCCL reduces GPU tensors only.
    table = torch.tensor([t[warmup:] for t in times.values()], dtype=torch.float64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    table = table.cpu()
    row = summarize(split.name, table[0].tolist(), table[1].tolist(), losses)
    cpu = summarize(split.name, table[2].tolist(), table[3].tolist(), losses)
    row.update(autopar_cpu_ms=cpu["autopar_ms"], hand_cpu_ms=cpu["hand_ms"], cpu_ratio=cpu["ratio"])
    return row


def summarize(name: str, autopar_s: list[float], hand_s: list[float],
              losses: dict[str, list[float]]) -> dict[str, Any]:
    """Medians, the paired ratio (median and quartiles of hand/autopar per step), loss check."""
    ratios = sorted(h / a for a, h in zip(autopar_s, hand_s))
    quart = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    diff = max(abs(a - h) / abs(h) for a, h in zip(losses["autopar"], losses["hand"]))
    return {
        "split": name,
        "autopar_ms": 1e3 * statistics.median(autopar_s),
        "hand_ms": 1e3 * statistics.median(hand_s),
        "ratio": statistics.median(ratios),
        "ratio_q1": quart[0],
        "ratio_q3": quart[2],
        "loss_rel_diff": diff,
        "losses": losses,
    }


def _rank_device(rank: int) -> Any:
    import torch

    if os.environ.get("AUTOPAR_BENCH_DEVICE", "cpu") == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _seq_vocab(model_text: str) -> tuple[int, int]:
    from autopar.models.resolve import parse_model_spec

    _, shape = parse_model_spec(model_text)
    return shape["seq_len"], shape["vocab"]


def _entry(rank: int, world_size: int, work: str, fn: Callable[..., Any], args: tuple,
           backend: str) -> None:
    # One rank: init the group over a FileStore (no ports), run, pickle the result, exit cleanly.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(work) / f"rank{rank}.pkl"
    try:
        dist.init_process_group(backend, init_method=f"file://{work}/store", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        out.write_bytes(pickle.dumps({"ok": fn(rank, world_size, *args)}))
    except BaseException:
        out.write_bytes(pickle.dumps({"error": traceback.format_exc()}))
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, device_type: str = "cpu",
           timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; their results."""
    import torch.multiprocessing as mp

    os.environ["AUTOPAR_BENCH_DEVICE"] = device_type
    backend = "nccl" if device_type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as work:
        ctx = mp.start_processes(_entry, args=(world_size, work, fn, args, backend),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result after {timeout_s:.0f} s")
        except Exception as err:  # a rank failed: report every rank's traceback
            errors = [f"rank {r}: {d['error']}" for r, d in _results(work, world_size)
                      if d and "error" in d]
            raise RuntimeError(f"{err}\n" + "\n".join(errors)) from None
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        return [d["ok"] for _, d in _results(work, world_size)]


def _results(work: str, world_size: int) -> list[tuple[int, dict[str, Any] | None]]:
    paths = [Path(work) / f"rank{r}.pkl" for r in range(world_size)]
    return [(r, pickle.loads(p.read_bytes()) if p.exists() else None)
            for r, p in enumerate(paths)]


def run_split(split: Split, *, warmup: int, steps: int, model_text: str = MODEL_TEXT,
              device_type: str = "cpu", dtype: str = "fp32") -> dict[str, Any]:
    """Plan ``split`` as ``autopar run`` does and measure it; rank 0's summary."""
    plan = make_plan(split, model_text, device_type=device_type, dtype=dtype)
    results = launch(bench_split, split.world_size, split, plan.to_dict(), model_text, warmup,
                     steps, device_type=device_type)
    return results[0]


# ---------------------------------------------------------------------------------------------
# Report


def format_table(rows: list[dict[str, Any]]) -> str:
    """The markdown results table."""
    lines = [
        "| split | ranks | autopar ms | hand ms | ratio (hand ms / autopar ms) | ratio p25-p75 "
        "| CPU ms autopar / hand (ratio) | loss max rel diff | >= 0.97 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = "yes" if r["ratio"] >= TARGET else "no"
        lines.append(
            f"| {r['split']} | {r['ranks']} | {r['autopar_ms']:.1f} | {r['hand_ms']:.1f} "
            f"| {r['ratio']:.3f} | {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f} "
            f"| {r['autopar_cpu_ms']:.1f} / {r['hand_cpu_ms']:.1f} ({r['cpu_ratio']:.3f}) "
            f"| {r['loss_rel_diff']:.1e} | {ok} |"
        )
    return "\n".join(lines)


def machine_facts(device_type: str, dtype: str = "fp32") -> list[str]:
    """CPU / GPU, cores, torch and Python versions, git commit, date."""
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=Path(__file__).parent, check=False).stdout.strip()
    facts = [f"CPU: {cpu}, {os.cpu_count()} cores", f"torch {torch.__version__}, "
             f"Python {platform.python_version()}, git {sha or 'unknown'}, {date.today()}"]
    if device_type == "cuda":
        facts.append(f"GPU: {torch.cuda.get_device_name()} (NCCL), {dtype}")
    else:
        facts.append(f"backend gloo, {dtype}, OMP_NUM_THREADS=1 per rank")
    return facts


def main(argv: list[str] | None = None) -> int:
    """Measure every split; print the table; write it to ``--out`` with the machine facts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per path")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per path")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--splits", default="", help="comma-separated split names (default all)")
    parser.add_argument("--model", default=MODEL_TEXT, help="zoo model text (kind:key=value,...)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                        help="bf16: autocast (FSDP2: MixedPrecisionPolicy) on both paths")
    parser.add_argument("--out", default="", help="write the markdown results here")
    args = parser.parse_args(argv)
    chosen = [s for s in SPLITS if not args.splits or s.name in args.splits.split(",")]
    rows = []
    for split in chosen:
        row = run_split(split, warmup=args.warmup, steps=args.steps, device_type=args.device,
                        model_text=args.model, dtype=args.dtype)
        row["ranks"] = split.world_size
        rows.append(row)
        print(f"{split.name}: autopar {row['autopar_ms']:.1f} ms, hand {row['hand_ms']:.1f} ms, "
              f"ratio {row['ratio']:.3f}, loss diff {row['loss_rel_diff']:.1e}", flush=True)
    table = format_table(rows)
    print(table)
    if args.out:
        _write_report(Path(args.out), table, args, argv)
    bad = [r["split"] for r in rows if r["loss_rel_diff"] > LOSS_RTOL]
    if bad:
        print(f"losses differ (not the same computation): {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


def _write_report(path: Path, table: str, args: argparse.Namespace, argv: list[str] | None
                  ) -> None:
    command = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime_overhead.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    facts = "\n".join(f"- {f}" for f in machine_facts(args.device, args.dtype))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# Runtime overhead: autopar vs the same split composed by hand in torch\n\n"
        f"Command: `{command.strip()}`\n\n{facts}\n- model `{args.model}`, global batch "
        f"{GLOBAL_BATCH}, AdamW; {args.warmup} warm-up steps, {args.steps} timed steps per path, "
        f"alternating A B B A\n\n{table}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
