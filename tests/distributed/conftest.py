"""Spawn harness for multi-process runtime tests: gloo over a FileStore in tmp_path, no ports.

``run_distributed(fn, world_size, *args, timeout_s=...)`` starts ``world_size`` processes with
``torch.multiprocessing`` (forkserver: fresh processes forked from a server that imported torch
once, ``tests.processes``), each running ``fn(rank, world_size, *args)`` after
``init_process_group("gloo", init_method="file://...", timeout=...)``; ``fn`` must be a
module-level function of a test module. Returns the per-rank results (picklable), or fails the
test with every failing rank's traceback. Each launch still costs a process group's setup and
teardown: group many checks in one ``fn``.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest


def _spawn_entry(
    rank: int,
    world_size: int,
    store_path: str,
    result_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    pg_timeout_s: float,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(result_dir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        out.write_bytes(pickle.dumps({"ok": result}))
    except BaseException:
        out.write_bytes(pickle.dumps({"error": traceback.format_exc()}))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # A clean exit for TP processes (runtime_notes.md): barrier, destroy, flush, _exit.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _collect(result_dir: Path, world_size: int) -> tuple[list[Any], list[str]]:
    results: list[Any] = [None] * world_size
    errors: list[str] = []
    for rank in range(world_size):
        path = result_dir / f"rank{rank}.pkl"
        if not path.exists():
            continue
        data = pickle.loads(path.read_bytes())
        if "error" in data:
            errors.append(f"rank {rank}:\n{data['error']}")
        else:
            results[rank] = data["ok"]
    return results, errors


@pytest.fixture
def run_distributed(tmp_path: Path) -> Callable[..., list[Any]]:
    """The launcher: ``run_distributed(fn, world_size, *args, timeout_s=120)``."""
    import torch.multiprocessing as mp

    from tests.processes import preloaded_forkserver

    preloaded_forkserver()
    launches = iter(range(1_000))

    def run(
        fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
    ) -> list[Any]:
        work = tmp_path / f"launch{next(launches)}"
        work.mkdir()
        pg_timeout_s = max(30.0, timeout_s / 2)
        context = mp.start_processes(
            _spawn_entry,
            args=(world_size, str(work / "store"), str(work), fn, args, pg_timeout_s),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        failure = ""
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    failure = f"timed out after {timeout_s:.0f} s"
                    break
        except Exception as e:  # a rank exited non-zero: torch kills the others
            failure = f"{type(e).__name__}: {e}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results, errors = _collect(work, world_size)
        if failure or errors:
            reason = failure or "rank error"
            pytest.fail(f"distributed run failed ({reason}):\n" + "\n".join(errors))
        return results

    return run
