"""Start the workers of ``autopar run`` with torchrun and collect what rank 0 measured.

The launcher runs ``python -m torch.distributed.run`` (torchrun) in a child process:
``--standalone`` on one node, or a c10d rendezvous (``--rdzv-backend c10d --rdzv-endpoint
host:port --nnodes N --node-rank R``) across nodes, with ``--max-restarts``. Each worker runs
``python -m autopar.runtime.worker ARGS`` (see ``worker.py``). Everything the workers and torchrun
print goes to this process's stderr, so stdout stays free for the one JSON document of ``--json``.
The local rank 0 of the node appends one JSON line per step to a result file in a private
temporary directory; after a torchrun restart the replayed steps overwrite the earlier records.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from autopar.errors import AutoparError, PlanMismatchError
from autopar.runtime.worker import WorkerArgs

__all__ = ["PG_TIMEOUT_S", "LaunchResult", "LaunchSpec", "launch", "launch_spec_for",
           "torchrun_command"]

# Default process-group timeout of the workers autopar launches (``autopar run`` and ``verify``):
# long enough for 8 oversubscribed CPU ranks, short enough that a hung collective fails in
# minutes rather than hours.
PG_TIMEOUT_S = 300.0

# Rendezvous id shared by every node of one multi-node job (torchrun's --rdzv-id).
RDZV_ID = "autopar"


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    """Where and how many workers to start.

    Attributes:
        nproc_per_node: worker processes on this node.
        nnodes: nodes in the job (1: ``--standalone``).
        node_rank: this node's index (0 .. nnodes - 1).
        rdzv_endpoint: ``host:port`` of the c10d rendezvous (required when nnodes > 1).
        max_restarts: torchrun restarts of the whole group after a worker fails.
    """

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    max_restarts: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchResult:
    """What one launch measured (from the node's local rank 0).

    Attributes:
        returncode: torchrun's exit code (0: every worker finished).
        losses: global mean loss of every step this launch ran, in step order.
        steps: the step numbers of ``losses`` (1-based).
        step_times_s: the slowest rank's wall time of each step.
        peak_memory_bytes: the largest per-rank peak of live tensor bytes over the launch.
        peak_memory_bytes_per_rank: each rank's peak over the launch (global rank order).
        world_size: the number of ranks (0 if no worker reported).
        finished: the workers reached the end of training.
    """

    returncode: int
    losses: tuple[float, ...]
    steps: tuple[int, ...]
    step_times_s: tuple[float, ...]
    peak_memory_bytes: int
    world_size: int
    finished: bool
    peak_memory_bytes_per_rank: tuple[int, ...] = ()


# HOST:PORT as torchrun's c10d rendezvous parses it: a host name or IPv4 address, or an IPv6
# address in brackets, then a port. Anything else makes torchrun retry without end.
_ENDPOINT = re.compile(
    r"(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?|\[[0-9A-Fa-f:.]+\]):(\d{1,5})")


def _is_endpoint(text: str) -> bool:
    match = _ENDPOINT.fullmatch(text)
    return match is not None and 1 <= int(match.group(1)) <= 65535


def launch_spec_for(
    *,
    world_size: int,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str,
    nproc_per_node: int | None,
    max_restarts: int,
) -> LaunchSpec:
    """The launch geometry of a plan's world size, checked against the node arguments.

    Raises:
        PlanMismatchError: the nodes do not hold exactly the plan's world size.
        AutoparError: an impossible node rank, a missing rendezvous endpoint, negative restarts.
    """
    if nnodes < 1:
        raise AutoparError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise AutoparError(f"--node-rank {node_rank} is not in 0..{nnodes - 1} (--nnodes {nnodes})")
    if max_restarts < 0:
        raise AutoparError(f"--max-restarts must be 0 or more, got {max_restarts}")
    if nnodes > 1 and not rdzv_endpoint:
        raise AutoparError(
            "a multi-node run needs --rdzv-endpoint HOST:PORT (the same on every node)"
        )
    if rdzv_endpoint and not _is_endpoint(rdzv_endpoint):
        raise AutoparError(
            f"--rdzv-endpoint {rdzv_endpoint[:80]!r} is not HOST:PORT (a host name or address, "
            "[v6 address] in brackets, and a port from 1 to 65535), e.g. node0:29500"
        )
    per_node = nproc_per_node if nproc_per_node is not None else world_size // nnodes
    if per_node < 1 or per_node * nnodes != world_size:
        raise PlanMismatchError(
            f"the plan needs {world_size} processes but the launch has {nnodes} node(s) x "
            f"{per_node} process(es); use --nnodes and --nproc-per-node whose product is "
            f"{world_size}, or a plan for {max(per_node, 1) * nnodes} processes"
        )
    return LaunchSpec(
        nproc_per_node=per_node, nnodes=nnodes, node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts,
    )


def torchrun_command(spec: LaunchSpec, args_path: str | Path) -> list[str]:
    """The torchrun command line that starts this node's workers.

    Args:
        spec: the launch geometry.
        args_path: the worker args JSON file.

    Returns:
        argv for ``subprocess``.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={spec.nproc_per_node}"]
    if spec.nnodes == 1 and not spec.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={RDZV_ID}",
            f"--nnodes={spec.nnodes}",
            f"--node-rank={spec.node_rank}",
        ]
    cmd += [f"--max-restarts={spec.max_restarts}", "-m", "autopar.runtime.worker", str(args_path)]
    return cmd


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    # Make this autopar importable in the workers even when it is not installed.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    # CUDA: grow allocator segments instead of splitting fixed ones, so the reserved memory
    # stays close to the allocated peak the cost model predicts (without it, 6 GiB of a 140 GiB
    # H200 sat reserved but unallocated when a plan at 100% of memory ran out; benchmarks/
    # results/h200/). A user's own PYTORCH_CUDA_ALLOC_CONF wins. Ignored on CPU.
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def _read_results(path: Path, returncode: int) -> LaunchResult:
    by_step: dict[int, dict] = {}
    world_size = 0
    finished = False
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("done"):
                finished = True
                world_size = int(record["world_size"])
            else:
                by_step[int(record["step"])] = record
    steps = tuple(sorted(by_step))
    return LaunchResult(
        returncode=returncode,
        losses=tuple(float(by_step[s]["loss"]) for s in steps),
        steps=steps,
        step_times_s=tuple(float(by_step[s]["step_time_s"]) for s in steps),
        peak_memory_bytes=max((int(r["peak_memory_bytes"]) for r in by_step.values()), default=0),
        world_size=world_size,
        finished=finished,
        peak_memory_bytes_per_rank=_per_rank_peaks(by_step.values()),
    )


def _per_rank_peaks(records: Iterable[dict]) -> tuple[int, ...]:
    """Element-wise maximum of the per-rank peaks over the steps."""
    peaks: list[int] = []
    for record in records:
        for rank, value in enumerate(record.get("peak_memory_bytes_per_rank", ())):
            if rank == len(peaks):
                peaks.append(int(value))
            else:
                peaks[rank] = max(peaks[rank], int(value))
    return tuple(peaks)


def launch(worker_args: WorkerArgs, spec: LaunchSpec) -> LaunchResult:
    """Run torchrun to completion on this node and return what the workers measured.

    Args:
        worker_args: the training job (its ``result_path`` is replaced by a private file).
        spec: the launch geometry.

    Returns:
        The launch's results; ``returncode`` is non-zero when torchrun failed.
    """
    with tempfile.TemporaryDirectory(prefix="autopar-run-") as tmp:
        result_path = Path(tmp) / "results.jsonl"
        args_path = Path(tmp) / "worker_args.json"
        args_path.write_text(replace(worker_args, result_path=str(result_path)).to_json())
        proc = subprocess.run(
            torchrun_command(spec, args_path),
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),
            stderr=sys.stderr.fileno(),
            env=_worker_env(),
            check=False,
        )
        return _read_results(result_path, proc.returncode)
