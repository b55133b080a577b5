"""Measure this machine for the cost model: matmul throughput, collectives, framework overhead.

``calibrate(nproc, device_type)`` starts ``nproc`` processes (gloo on CPU, NCCL on GPU; a file
store, no ports) that measure, all at the same time so that contention for shared cores is part
of the figures:

- matmul: seconds per call of (m x k)(k x n) products over sizes, fp32 on CPU and bf16 on GPU,
  fitted to ``t = t0 + F / R`` (``autopar.cost_model.calibration``): R is the achieved peak and
  t0 the fixed cost of a call, so the efficiency ``F / (t R)`` rises with size;
- collectives: all_reduce, all_gather_into_tensor, reduce_scatter_tensor over the whole group,
  send/recv between rank pairs and (4 or more processes) all_reduce in concurrent pairs: median
  seconds per call over sizes (the first call at each size is discarded), fitted to
  ``t = alpha + factor S / B`` per collective;
- framework overhead: one transformer block of the zoo (gpt and llama) at a tiny width, where the
  arithmetic is negligible, run forward + backward eagerly, with its linears as DTensors
  (``parallelize_module`` on a one-rank mesh) and under FSDP2 (``fully_shard`` on a one-rank
  mesh): seconds per block and per dispatched aten op (``calibrate_measure.py``).

The fits are the cost model's (``autopar.cost_model.calibration``); the command that writes the
cluster YAML is ``autopar/cli/cmd_calibrate.py``.

Units: seconds, bytes, FLOPs, bytes per second, FLOP/s.
"""

from __future__ import annotations

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

from autopar.cost_model.calibration import (
    Calibration,
    CollectiveFit,
    fit_linear_relative,
    median,
)
from autopar.cost_model.comm import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    SEND_RECV,
    bus_factor,
)
from autopar.models.zoo import TORCH_DTYPES
from autopar.runtime.calibrate_measure import (
    max_over_ranks,
    mean_over_ranks,
    measure_overheads,
    sync,
)
from autopar.runtime.launch import PG_TIMEOUT_S
from autopar.runtime.mesh import backend_of, default_dtype

__all__ = ["Sweep", "calibrate"]

COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, SEND_RECV)
# All-reduce in concurrent groups of 2 (measured when nproc >= 4 is even): the latency of the
# small groups that tp=2 or dp=2 splits create, under the contention of the whole machine.
PAIRS_ALL_REDUCE = "all_reduce_pairs"


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


def _time_call(fn, device: torch.device, min_time_s: float) -> float:
    """Median over 3 repetitions of seconds per call, each repetition >= min_time_s.

    On GPU every call is synchronised before the clock is read, so the host cannot queue more
    work than the time budget (the sync latency becomes part of the fixed cost of a call).
    """
    fn()  # first call: allocation, kernel selection
    sync(device)
    per_call = []
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            sync(device)
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
        out.append([m, k, n, mean_over_ranks(seconds, device)])
    return out


def _collective_call(op: str, size_bytes: int, device: torch.device, pair_group: Any = None):
    """A zero-argument function running one call of ``op`` on a buffer of ``size_bytes``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = max(size_bytes // 4 // world * world, world)
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    if op == ALL_REDUCE:
        return lambda: dist.all_reduce(buf)
    if op == PAIRS_ALL_REDUCE:  # every pair (0, 1), (2, 3), ... at once, as tp=2 groups run
        return lambda: dist.all_reduce(buf, group=pair_group)
    if op == ALL_GATHER:  # S = the gathered output
        shard = torch.ones(numel // world, dtype=torch.float32, device=device)
        return lambda: dist.all_gather_into_tensor(buf, shard)
    if op == REDUCE_SCATTER:  # S = the reduced input
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
            sync(device)
            times = []
            # Small sizes are cheap and latency-bound, hence the noisiest: time more calls.
            for _ in range(sweep.repeats if size >= 1 << 20 else 2 * sweep.repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                call()
                sync(device)
                times.append(time.perf_counter() - start)
            rows.append([size, max_over_ranks(median(times), device)])
        out[op] = rows
    return out


def _worker(rank: int, nproc: int, store_path: str, device_type: str, sweep_json: str,
            out_path: str) -> None:
    """One calibration process (spawned): measure everything, rank 0 writes the JSON."""
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    dtype = TORCH_DTYPES[default_dtype(device_type)]
    dist.init_process_group(backend_of(device_type), init_method=f"file://{store_path}",
                            rank=rank, world_size=nproc, timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        sweep = Sweep.from_json(sweep_json)
        result: dict[str, Any] = {"matmul": _measure_matmuls(sweep, dtype, device)}
        result["memory_bytes_per_s"] = mean_over_ranks(
            _measure_copy_bytes_per_s(device, sweep.min_time_s), device)
        result.update(measure_overheads(sweep.overhead_iters, device))
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
        op = ALL_REDUCE if key == PAIRS_ALL_REDUCE else key
        group = 2 if key in (SEND_RECV, PAIRS_ALL_REDUCE) else nproc
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
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise ValueError(f"nproc {nproc} exceeds the {torch.cuda.device_count()} visible GPUs")
    sweep = sweep or Sweep.default(device_type, quick=quick)
    start = time.perf_counter()
    raw = _measure_in_processes(nproc, device_type, sweep)
    return _calibration(raw, nproc, device_type, wall_s=time.perf_counter() - start)


def _measure_in_processes(nproc: int, device_type: str, sweep: Sweep) -> dict[str, Any]:
    """Spawn the ``nproc`` measuring processes; rank 0's results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autopar-calibrate-") as tmp:
        out_path = Path(tmp) / "result.json"
        mp.start_processes(
            _worker,
            args=(nproc, str(Path(tmp) / "store"), device_type, sweep.to_json(), str(out_path)),
            nprocs=nproc, join=True, start_method="spawn",
        )
        if not out_path.exists():
            raise RuntimeError("calibration processes ended without writing their results")
        return json.loads(out_path.read_text())


_OVERHEAD_FIELDS = (
    "op_overhead_s", "layer_overhead_s", "dtensor_layer_overhead_s", "fsdp_layer_overhead_s",
    "nonblock_overhead_s", "dtensor_module_overhead_s", "optimizer_layer_overhead_s",
    "optimizer_nonblock_overhead_s", "dtensor_optimizer_layer_overhead_s",
    "recompute_layer_overhead_s",
)


def _calibration(raw: dict[str, Any], nproc: int, device_type: str, *, wall_s: float
                 ) -> Calibration:
    """The fits of the processes' raw measurements."""
    matmul = tuple((int(m), int(k), int(n), float(t)) for m, k, n, t in raw["matmul"])
    fit = fit_linear_relative([2.0 * m * k * n for m, k, n, _ in matmul], [t for *_, t in matmul])
    return Calibration(
        device_type=device_type,
        nproc=nproc,
        dtype=default_dtype(device_type),
        matmul_samples=matmul,
        matmul_fixed_s=fit.fixed_s,
        matmul_peak_flops=fit.rate,
        matmul_median_rel_error=fit.median_rel_error,
        collectives=_fit_collectives(raw["collectives"], nproc),
        **{name: raw[name] for name in _OVERHEAD_FIELDS},
        cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 0),
        memory_bytes_per_s=raw["memory_bytes_per_s"],
        device_name=torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu",
        wall_s=wall_s,
    )
