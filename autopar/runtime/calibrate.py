"""Measure this machine for the cost model: matmul throughput, collectives, framework overhead.

``calibrate(nproc, device_type)`` starts ``nproc`` processes (gloo on CPU, NCCL on GPU; a file
store, no ports) that measure, all at the same time so that contention for shared cores is part
of the figures:

- matmul: seconds per call of (m x k)(k x n) products over sizes, fp32 on CPU and bf16 on GPU,
  fitted to ``t = t0 + F / R`` (``autopar.calibration_fit``): R is the achieved peak and t0 the
  fixed cost of a call, so the efficiency ``F / (t R)`` rises with size;
- collectives: all_reduce, all_gather_into_tensor, reduce_scatter_tensor over the whole group,
  send/recv between rank pairs and (4 or more processes) all_reduce in concurrent pairs: median
  seconds per call over sizes (the first call at each size is discarded), fitted to
  ``t = alpha + factor S / B`` per collective;
- framework overhead: one transformer block of the zoo (gpt and llama) at a tiny width, where the
  arithmetic is negligible, run forward + backward eagerly, with its linears as DTensors
  (``parallelize_module`` on a one-rank mesh) and under FSDP2 (``fully_shard`` on a one-rank
  mesh): seconds per block and per dispatched aten op.

Units: seconds, bytes, FLOPs, bytes per second, FLOP/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.calibration_fit import (
    Calibration,
    CollectiveFit,
    bus_factor,
    calibration_to_cluster,
    fit_linear_relative,
    median,
)

__all__ = [
    "Calibration",
    "CollectiveFit",
    "Sweep",
    "add_calibrate_arguments",
    "calibrate",
    "calibrate_command",
    "calibration_to_cluster",
]

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "send_recv")
# All-reduce in concurrent groups of 2 (measured when nproc >= 4 is even): the latency of the
# small groups that tp=2 or dp=2 splits create, under the contention of the whole machine.
PAIRS_ALL_REDUCE = "all_reduce_pairs"
# Shortest window a framework-overhead figure averages over (several scheduler time slices).
OVERHEAD_WINDOW_S = 0.1
# Shape at which the fixed per-layer cost is measured (a small model's: operators on [b, s, h]
# tensors of this size cost more than their dispatch).
SMALL_HIDDEN = 128
SMALL_SEQ = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class Sweep:
    """What to measure.

    Attributes:
        matmul_shapes: (m, k, n) of the matmuls timed.
        collective_sizes_bytes: buffer sizes S of the collectives.
        min_time_s: time each matmul size for at least this long per repetition.
        repeats: timed calls per collective size (after one discarded call).
        overhead_iters: timed forward + backward passes of the tiny block.
    """

    matmul_shapes: tuple[tuple[int, int, int], ...]
    collective_sizes_bytes: tuple[int, ...]
    min_time_s: float
    repeats: int
    overhead_iters: int

    def to_json(self) -> str:
        """The sweep as JSON (what the measuring processes receive)."""
        return json.dumps({name: getattr(self, name) for name in Sweep.__slots__})

    @classmethod
    def from_json(cls, text: str) -> Sweep:
        """Inverse of ``to_json``."""
        data = json.loads(text)
        data["matmul_shapes"] = tuple(tuple(shape) for shape in data["matmul_shapes"])
        data["collective_sizes_bytes"] = tuple(data["collective_sizes_bytes"])
        return cls(**data)

    @classmethod
    def default(cls, device_type: str, *, quick: bool = False) -> Sweep:
        """The sweep for a device type; ``quick`` is a shorter one for tests."""
        if device_type == "cuda":
            sizes = tuple(1 << e for e in range(16, 31, 2))  # 64 KiB .. 1 GiB
            shapes = tuple((n, n, n) for n in (256, 512, 1024, 2048, 4096, 8192))
            return cls(matmul_shapes=shapes, collective_sizes_bytes=sizes, min_time_s=0.05,
                       repeats=10, overhead_iters=50)
        squares = (32, 64, 128, 256, 512) if quick else (16, 32, 64, 128, 256, 384, 512)
        rects = ((256, 64, 256), (256, 256, 64), (128, 64, 1024)) if not quick else ()
        sizes = (4096, 65536, 1 << 20, 1 << 22) if quick else (
            4096, 32768, 262144, 1 << 20, 1 << 22, 1 << 24)
        return cls(
            matmul_shapes=tuple((n, n, n) for n in squares) + rects,
            collective_sizes_bytes=sizes,
            min_time_s=0.01 if quick else 0.03,
            repeats=3 if quick else 5,
            overhead_iters=8 if quick else 15,
        )


# ---------------------------------------------------------------- measurement (in each process)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _time_call(fn, device: torch.device, min_time_s: float) -> float:
    """Median over 3 repetitions of seconds per call, each repetition >= min_time_s.

    On GPU every call is synchronised before the clock is read, so the host cannot queue more
    work than the time budget (the sync latency becomes part of the fixed cost of a call).
    """
    fn()  # first call: allocation, kernel selection
    _sync(device)
    per_call = []
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            _sync(device)
            calls += 1
            if calls >= 3 and time.perf_counter() - start >= min_time_s:
                break
        per_call.append((time.perf_counter() - start) / calls)
    return median(per_call)


def _measure_copy_bytes_per_s(device: torch.device, min_time_s: float) -> float:
    """Bytes read + written per second copying a 16 MiB tensor (2 x 16 MiB per call)."""
    x = torch.ones(1 << 22, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    dist.barrier()
    seconds = _time_call(lambda: y.copy_(x), device, min_time_s)
    return 2.0 * x.numel() * x.element_size() / seconds


def _measure_matmuls(sweep: Sweep, dtype: torch.dtype, device: torch.device) -> list[list]:
    out = []
    for m, k, n in sweep.matmul_shapes:
        dist.barrier()
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        seconds = _time_call(lambda a=a, b=b: a @ b, device, sweep.min_time_s)
        out.append([m, k, n, _mean_over_ranks(seconds, device)])
    return out


def _collective_call(op: str, size_bytes: int, device: torch.device, pair_group: Any = None):
    """A zero-argument function running one call of ``op`` on a buffer of ``size_bytes``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = max(size_bytes // 4 // world * world, world)
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(buf)
    if op == PAIRS_ALL_REDUCE:  # every pair (0, 1), (2, 3), ... at once, as tp=2 groups run
        return lambda: dist.all_reduce(buf, group=pair_group)
    if op == "all_gather_into_tensor":  # S = the gathered output
        shard = torch.ones(numel // world, dtype=torch.float32, device=device)
        return lambda: dist.all_gather_into_tensor(buf, shard)
    if op == "reduce_scatter_tensor":  # S = the reduced input
        shard = torch.empty(numel // world, dtype=torch.float32, device=device)
        return lambda: dist.reduce_scatter_tensor(shard, buf)
    # send/recv between pairs (0 -> 1, 2 -> 3, ...); an odd last rank idles.
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if peer >= world:
        return lambda: None
    if rank % 2 == 0:
        return lambda: dist.send(buf, peer)
    return lambda: dist.recv(buf, peer)


def _measure_collectives(sweep: Sweep, device: torch.device) -> dict[str, list[list]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    ops, pair_group = list(COLLECTIVES), None
    if world >= 4 and world % 2 == 0:
        # Every rank takes part in creating every group (torch's rule for new_group).
        groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
        pair_group = groups[rank // 2]
        ops.append(PAIRS_ALL_REDUCE)
    out: dict[str, list[list]] = {}
    for op in ops:
        rows = []
        for size in sweep.collective_sizes_bytes:
            call = _collective_call(op, size, device, pair_group)
            dist.barrier()
            call()  # discarded: connection set-up and buffer allocation
            _sync(device)
            times = []
            # Small sizes are cheap and latency-bound, hence the noisiest: time more calls.
            for _ in range(sweep.repeats if size >= 1 << 20 else 2 * sweep.repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                call()
                _sync(device)
                times.append(time.perf_counter() - start)
            rows.append([size, _max_over_ranks(median(times), device)])
        out[op] = rows
    return out


def _count_ops(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    counter = _Count()
    with counter:
        fn()
    return counter.calls


def _time_median(fn, iters: int, device: torch.device) -> float:
    """Seconds per call of ``fn``: median of 3 repetitions, each the mean over at least
    ``iters`` calls and OVERHEAD_WINDOW_S seconds.

    A mean over a window longer than the scheduler's time slice, not a median of single calls:
    with more processes than cores a call shorter than a slice is either not preempted or
    preempted for a whole slice, and the median of single calls would miss the sharing.
    """
    for _ in range(3):
        fn()
    dist.barrier()
    per_call = []
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while calls < iters or time.perf_counter() - start < OVERHEAD_WINDOW_S:
            fn()
            _sync(device)
            calls += 1
        per_call.append((time.perf_counter() - start) / calls)
    return median(per_call)


def _time_fwd_bwd(module: Any, x: torch.Tensor, iters: int,
                  device: torch.device) -> float:
    """Forward + backward of a block (output summed) or of a model (the runtime's loss)."""
    from autopar.models import cross_entropy_loss

    def run() -> None:
        out = module(x)
        loss = out.sum() if x.is_floating_point() else cross_entropy_loss(out, x)
        loss.backward()

    return _time_median(run, iters, device)


def _time_optimizer(module: torch.nn.Module, iters: int, device: torch.device) -> float:
    """Seconds of one AdamW step (the runtime's optimizer) over ``module``'s parameters."""
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    return _time_median(opt.step, iters, device)


def _zoo_model(kind: str, device: torch.device, *, small: bool) -> torch.nn.Module:
    """A one-block zoo model: tiny (width 16, dispatch only) or small (width SMALL_HIDDEN)."""
    from autopar.models import build

    h, heads, vocab, seq = (SMALL_HIDDEN, 4, 512, SMALL_SEQ) if small else (16, 2, 32, 8)
    shape = {"layers": 1, "hidden": h, "heads": heads, "vocab": vocab, "seq_len": seq}
    if kind == "llama":
        shape["kv_heads"] = heads // 2
    return build(kind, device=device, seed=0, **shape)


def _fixed_part(module: Any, inputs: list[torch.Tensor], iters: int,
                device: torch.device) -> float:
    """The batch-independent seconds of a forward + backward: t(b) = fixed + b * per-sample,
    extrapolated to b = 0 from b = 1 and 2 (``inputs``), fixed = 2 t(1) - t(2)."""
    t1, t2 = (_time_fwd_bwd(module, x, iters, device) for x in inputs)
    return 2.0 * t1 - t2


def _tp_styles(block: torch.nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, Any] = {}
    for fqn, _ in block.named_modules():
        leaf = fqn.rsplit(".", 1)[-1]
        if leaf in ("wq", "wk", "wv", "w1", "w3"):
            styles[fqn] = ColwiseParallel()
        elif leaf in ("wo", "w2"):
            styles[fqn] = RowwiseParallel()
    return styles


def _measure_kind(kind: str, mesh: Any, iters: int, device: torch.device) -> dict[str, float]:
    """The overheads of one zoo kind's tiny block and model (seconds; see _measure_overheads)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(1, 8, 16, device=device, requires_grad=True)
    tokens = torch.randint(0, 32, (1, 8), device=device)
    block = _zoo_model(kind, device, small=False).layers["0"]
    out = {"ops": float(_count_ops(lambda: block(x).sum().backward()))}
    out["block"] = _time_fwd_bwd(block, x, iters, device)
    out["opt_block"] = _time_optimizer(block, iters, device)
    model = _zoo_model(kind, device, small=False)
    out["nonblock"] = max(_time_fwd_bwd(model, tokens, iters, device) - out["block"], 0.0)
    out["opt_nonblock"] = max(_time_optimizer(model, iters, device) - out["opt_block"], 0.0)
    # At a small model's shapes the operators cost more than their dispatch: the fixed part
    # of a block (and of the rest of a one-block model) at width SMALL_HIDDEN, never below the
    # tiny block's.
    small = _zoo_model(kind, device, small=True)
    xs = [torch.randn(b, SMALL_SEQ, SMALL_HIDDEN, device=device, requires_grad=True)
          for b in (1, 2)]
    out["block_fixed"] = max(_fixed_part(small.layers["0"], xs, iters, device), out["block"])
    toks = [torch.randint(0, 512, (b, SMALL_SEQ), device=device) for b in (1, 2)]
    out["nonblock_fixed"] = max(_fixed_part(small, toks, iters, device) - out["block_fixed"],
                                out["nonblock"])
    block = _zoo_model(kind, device, small=False).layers["0"]
    styles = _tp_styles(block)
    parallelize_module(block, mesh["tp"], styles)
    out["tp_modules"] = float(len(styles))
    out["dtensor"] = max(_time_fwd_bwd(block, x, iters, device) - out["block"], 0.0)
    out["opt_dtensor"] = max(_time_optimizer(block, iters, device) - out["opt_block"], 0.0)
    block = _zoo_model(kind, device, small=False).layers["0"]
    fully_shard(block, mesh=mesh["tp"])
    out["fsdp"] = max(_time_fwd_bwd(block, x, iters, device) - out["block"], 0.0)
    out["opt_fsdp"] = max(_time_optimizer(block, iters, device) - out["opt_block"], 0.0)
    # The same extras at the small shape (their fixed parts), never below the tiny ones.
    block = _zoo_model(kind, device, small=True).layers["0"]
    parallelize_module(block, mesh["tp"], _tp_styles(block))
    out["dtensor"] = max(_fixed_part(block, xs, iters, device) - out["block_fixed"],
                         out["dtensor"])
    block = _zoo_model(kind, device, small=True).layers["0"]
    fully_shard(block, mesh=mesh["tp"])
    out["fsdp"] = max(_fixed_part(block, xs, iters, device) - out["block_fixed"], out["fsdp"])
    block = small.layers["0"]  # non-reentrant checkpointing: the runtime's full recompute
    rerun = functools.partial(checkpoint, block, use_reentrant=False)
    out["checkpoint"] = max(_fixed_part(rerun, xs, iters, device) - out["block_fixed"], 0.0)
    return out


def _measure_overheads(sweep: Sweep, device: torch.device) -> dict[str, float]:
    """Framework seconds of the zoo's tiny blocks and models (gpt and llama averaged).

    Forward + backward of one block: eager, with DTensor linears (TP on a one-rank mesh, per
    sharded module) and under FSDP2 (one-rank mesh); of the rest of a one-block model
    (embedding, head, loss); one AdamW step over a block's parameters as plain tensors and as
    DTensors (what TP and FSDP2 make them), and over the rest of the model; per aten op.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("dp", "tp"))
    runs = [_measure_kind(kind, mesh, sweep.overhead_iters, device) for kind in ("gpt", "llama")]

    def mean(key: str) -> float:
        return _mean_over_ranks(sum(r[key] for r in runs) / len(runs), device)

    opt_dtensor = 0.5 * (mean("opt_dtensor") + mean("opt_fsdp"))
    return {
        "op_overhead_s": mean("block") / mean("ops"),
        "layer_overhead_s": mean("block_fixed"),
        "nonblock_overhead_s": mean("nonblock_fixed"),
        "dtensor_layer_overhead_s": mean("dtensor"),
        "dtensor_module_overhead_s": _mean_over_ranks(
            sum(r["dtensor"] / r["tp_modules"] for r in runs) / len(runs), device),
        "fsdp_layer_overhead_s": mean("fsdp"),
        "optimizer_layer_overhead_s": mean("opt_block"),
        "optimizer_nonblock_overhead_s": mean("opt_nonblock"),
        "dtensor_optimizer_layer_overhead_s": opt_dtensor,
        "recompute_layer_overhead_s": mean("checkpoint"),
    }


def _worker(rank: int, nproc: int, store_path: str, device_type: str, sweep_json: str,
            out_path: str) -> None:
    """One calibration process (spawned): measure everything, rank 0 writes the JSON."""
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device, backend, dtype = torch.device("cuda", rank), "nccl", torch.bfloat16
    else:
        device, backend, dtype = torch.device("cpu"), "gloo", torch.float32
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                            world_size=nproc, timeout=timedelta(seconds=120))
    try:
        sweep = Sweep.from_json(sweep_json)
        result: dict[str, Any] = {"matmul": _measure_matmuls(sweep, dtype, device)}
        result["memory_bytes_per_s"] = _mean_over_ranks(
            _measure_copy_bytes_per_s(device, sweep.min_time_s), device)
        result.update(_measure_overheads(sweep, device))
        result["collectives"] = _measure_collectives(sweep, device) if nproc > 1 else {}
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Clean exit (reference/runtime_notes.md): processes that used DTensor can abort during
    # interpreter shutdown after all their work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- orchestration (parent process)


def _fit_collectives(raw: dict[str, list[list]], nproc: int) -> tuple[CollectiveFit, ...]:
    fits = []
    for key in (*COLLECTIVES, PAIRS_ALL_REDUCE):
        rows = raw.get(key)
        if not rows:
            continue
        op = "all_reduce" if key == PAIRS_ALL_REDUCE else key
        group = 2 if key in ("send_recv", PAIRS_ALL_REDUCE) else nproc
        factor = bus_factor(op, group)
        fit = fit_linear_relative([factor * s for s, _ in rows], [t for _, t in rows])
        fits.append(CollectiveFit(
            op=op, group_size=group, latency_s=fit.fixed_s, bandwidth_bytes_per_s=fit.rate,
            median_rel_error=fit.median_rel_error, max_rel_error=fit.max_rel_error,
            samples=tuple((int(s), float(t)) for s, t in rows),
        ))
    return tuple(fits)


def calibrate(nproc: int, device_type: str = "cpu", *, sweep: Sweep | None = None,
              quick: bool = False) -> Calibration:
    """Measure this machine with ``nproc`` concurrent processes and fit the cost-model terms.

    Args:
        nproc: processes (devices) to measure with; collectives need 2 or more.
        device_type: "cpu" (gloo, fp32) or "cuda" (NCCL, bf16; one GPU per process).
        sweep: the sizes to measure (default: ``Sweep.default(device_type, quick=quick)``).
        quick: a shorter default sweep (tests).

    Returns:
        The measurements and their fits.

    Raises:
        ValueError: nproc < 1, an unknown device type, or more processes than GPUs.
        RuntimeError: a measuring process failed.
    """
    import torch.multiprocessing as mp

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise ValueError(f"nproc {nproc} exceeds the {torch.cuda.device_count()} visible GPUs")
    sweep = sweep or Sweep.default(device_type, quick=quick)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autopar-calibrate-") as tmp:
        out_path = Path(tmp) / "result.json"
        mp.start_processes(
            _worker,
            args=(nproc, str(Path(tmp) / "store"), device_type, sweep.to_json(), str(out_path)),
            nprocs=nproc, join=True, start_method="spawn",
        )
        if not out_path.exists():
            raise RuntimeError("calibration processes ended without writing their results")
        raw = json.loads(out_path.read_text())
    matmul = tuple((int(m), int(k), int(n), float(t)) for m, k, n, t in raw["matmul"])
    fit = fit_linear_relative([2.0 * m * k * n for m, k, n, _ in matmul], [t for *_, t in matmul])
    return Calibration(
        device_type=device_type,
        nproc=nproc,
        dtype="bf16" if device_type == "cuda" else "fp32",
        matmul_samples=matmul,
        matmul_fixed_s=fit.fixed_s,
        matmul_peak_flops=fit.rate,
        matmul_median_rel_error=fit.median_rel_error,
        collectives=_fit_collectives(raw["collectives"], nproc),
        op_overhead_s=raw["op_overhead_s"],
        layer_overhead_s=raw["layer_overhead_s"],
        dtensor_layer_overhead_s=raw["dtensor_layer_overhead_s"],
        fsdp_layer_overhead_s=raw["fsdp_layer_overhead_s"],
        nonblock_overhead_s=raw["nonblock_overhead_s"],
        dtensor_module_overhead_s=raw["dtensor_module_overhead_s"],
        optimizer_layer_overhead_s=raw["optimizer_layer_overhead_s"],
        optimizer_nonblock_overhead_s=raw["optimizer_nonblock_overhead_s"],
        dtensor_optimizer_layer_overhead_s=raw["dtensor_optimizer_layer_overhead_s"],
        recompute_layer_overhead_s=raw["recompute_layer_overhead_s"],
        cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 0),
        memory_bytes_per_s=raw["memory_bytes_per_s"],
        device_name=torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu",
        wall_s=time.perf_counter() - start,
    )


# ---------------------------------------------------------------- command line


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the arguments of ``autopar calibrate`` on ``parser``."""
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes (devices) to measure with (default: the visible GPUs, "
                        "else 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="device type (default: cuda when a GPU is visible)")
    parser.add_argument("--out", default="cluster.yaml",
                        help="cluster YAML to write (default cluster.yaml)")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    parser.add_argument("--quick", action="store_true", help="a shorter sweep (less accurate)")
    parser.add_argument("--json", action="store_true",
                        help="print the raw measurements and fits as JSON on stdout")


def calibrate_command(args: argparse.Namespace) -> int:
    """Run ``autopar calibrate``: measure, write the cluster YAML, print a summary.

    Raises:
        AutoparError: --out exists without --force, or an impossible --nproc.
    """
    from autopar.errors import AutoparError

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    nproc = args.nproc or (torch.cuda.device_count() if device_type == "cuda" else 2)
    out = Path(args.out)
    if out.exists() and not args.force:
        raise AutoparError(f"{out} exists; pass --force to overwrite it or choose another --out")
    if not out.parent.exists():
        raise AutoparError(f"cannot write {out}: directory {out.parent} does not exist")
    if nproc < 1:
        raise AutoparError(f"--nproc must be at least 1, got {nproc}")
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise AutoparError(f"--nproc {nproc} exceeds the {torch.cuda.device_count()} visible GPUs")
    cal = calibrate(nproc, device_type, quick=args.quick)
    cluster = calibration_to_cluster(cal)
    cluster.to_yaml(out)
    summary = format_calibration(cal) + f"wrote {out}\n"
    if args.json:
        print(summary, end="", file=sys.stderr)
        print(json.dumps(cal.to_dict(), sort_keys=True))
    else:
        print(summary, end="")
    return 0


def format_calibration(cal: Calibration) -> str:
    """A short human-readable summary of a calibration."""
    lines = [
        f"calibrated {cal.nproc} {cal.device_type} process(es) in {cal.wall_s:.1f} s",
        f"  matmul ({cal.dtype}): {cal.matmul_peak_flops / 1e9:.1f} GFLOP/s per process, "
        f"{cal.matmul_fixed_s * 1e6:.1f} us per call (fit error {cal.matmul_median_rel_error:.0%})",
        f"  copy bandwidth: {cal.memory_bytes_per_s / 1e9:.2f} GB/s per process",
        f"  framework: {cal.op_overhead_s * 1e6:.1f} us per op, block fwd+bwd "
        f"{cal.layer_overhead_s * 1e3:.2f} ms, +{cal.dtensor_layer_overhead_s * 1e3:.2f} ms "
        f"with DTensor ({cal.dtensor_module_overhead_s * 1e3:.2f} ms per module), "
        f"+{cal.fsdp_layer_overhead_s * 1e3:.2f} ms with FSDP2; rest of the model "
        f"{cal.nonblock_overhead_s * 1e3:.2f} ms",
        f"  AdamW step: {cal.optimizer_layer_overhead_s * 1e3:.2f} ms per block, "
        f"+{cal.dtensor_optimizer_layer_overhead_s * 1e3:.2f} ms with DTensor parameters; "
        f"checkpointed block +{cal.recompute_layer_overhead_s * 1e3:.2f} ms; "
        f"{cal.cpu_cores or '?'} cores",
    ]
    for c in cal.collectives:
        lines.append(
            f"  {c.op:<24s} n={c.group_size}: alpha {c.latency_s * 1e3:.3f} ms, "
            f"bus bandwidth {c.bandwidth_bytes_per_s / 1e9:.2f} GB/s "
            f"(fit error median {c.median_rel_error:.0%}, max {c.max_rel_error:.0%})"
        )
    return "\n".join(lines) + "\n"
