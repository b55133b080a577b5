"""Fresh processes for tests without paying ``import torch`` in each (one home).

Every ``autopar run`` a test makes, and every rank ``run_distributed`` starts, is a new process:
nothing a test does can leak into the next, and a crash fails one test. Starting one the usual way
(``python -m autopar.cli``, or a ``spawn``) re-imports torch, torch._dynamo (imported on the first
dispatch through a ``TorchDispatchMode``) and torch.distributed: 5-6 s of CPU on a 2-core CI
machine, more than a tiny run itself. Instead both fork from multiprocessing's ``forkserver``,
a single-threaded server process that imported those modules once (``PRELOAD``); each child is
still a fresh process that runs ``autopar.cli.main`` (or the rank's function) once and exits.

The console entry point itself (``python -m autopar.cli``) stays covered by the tests that start
it as a real subprocess (the two-node rendezvous, the unit CLI tests).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from multiprocessing.context import ForkServerContext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What every child would import anyway, imported once by the server. A module missing here is
# only slower (the child imports it).
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "autopar.cli",
    "autopar.cli.cmd_run",
    "autopar.runtime.worker",
)


def preloaded_forkserver() -> ForkServerContext:
    """multiprocessing's ``forkserver`` context, its server preloading ``PRELOAD``.

    The server is one per test process, started by the first child of either kind (its preload
    list must be set before: call this first). ``OMP_NUM_THREADS=1`` is set before the server
    starts, so torch in every child uses one thread, as the tests' own launches ask.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    context = multiprocessing.get_context("forkserver")
    assert isinstance(context, ForkServerContext)
    context.set_forkserver_preload(list(PRELOAD))
    return context


def _cli_child(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked child: the environment, working directory and standard streams of a fresh
    ``autopar ARGV`` process, then ``main`` once; exits with its code."""
    os.setsid()  # its own process group: a timeout kills torchrun and the workers too
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    code = 1
    try:
        from autopar.cli import main

        code = main(argv)
    except SystemExit as stop:  # argparse's --help and --version
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop_group(pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM to the command's process group (torchrun's agent stops its workers on it), then
    SIGKILL to whatever of the group is left after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def run_autopar(
    *args: str, env: Mapping[str, str] | None = None, timeout_s: float = 150.0
) -> subprocess.CompletedProcess:
    """``autopar ARGS`` as a fresh process in the repository root, its streams captured as text.

    Args:
        args: the command line after ``autopar`` (``"run", MODEL, ...``).
        env: variables added to this process's environment (``OMP_NUM_THREADS=1`` and the
            repository on ``PYTHONPATH`` are always set, as for a subprocess).
        timeout_s: the whole command's limit; past it, its process group is killed and
            ``subprocess.TimeoutExpired`` raised (``_stop_group``).

    Returns:
        A ``CompletedProcess`` like ``subprocess.run(..., capture_output=True, text=True)``.
    """
    context = preloaded_forkserver()
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p
    )
    full_env.update(env or {})
    argv = list(args)
    with tempfile.TemporaryDirectory(prefix="autopar-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        child = context.Process(
            target=_cli_child, args=(argv, full_env, str(ROOT), str(out), str(err))
        )
        child.start()
        assert child.pid is not None
        child.join(timeout_s)
        if child.is_alive():
            _stop_group(child.pid)
            child.join()
            raise subprocess.TimeoutExpired(["autopar", *argv], timeout_s)
        assert child.exitcode is not None  # joined: it has exited
        return subprocess.CompletedProcess(
            ["autopar", *argv], child.exitcode, out.read_text(), err.read_text()
        )
