"""``autopar run`` end to end, as a user runs it: one process, dp, resume, faults, multi-node.

Each test starts ``autopar run`` as a fresh process (torchrun and its workers below it; forked from
a server that imported torch once, ``tests.processes``; the two-node test starts the console
entry point itself as real subprocesses). Launches are grouped: the one-process and dp=2 4-step
runs are module fixtures that several tests compare against.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import write_cpu_plan
from tests.processes import run_autopar

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
# A tiny GPT: 2 blocks, width 32, 4 heads (tp 2 divides heads and seq_len), 64 tokens, 16 positions.
MODEL = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq_len=16"
# Every launch of these tests trains on this global batch.
BATCH = ["--global-batch", "4"]


def autopar_run(*args: str, env: dict[str, str] | None = None, timeout_s: float = 150.0,
                ) -> subprocess.CompletedProcess:
    """``autopar run ARGS`` as a fresh process (``tests.processes``), streams captured as text."""
    return run_autopar("run", *args, env=env, timeout_s=timeout_s)


def run_json(*args: str, env: dict[str, str] | None = None, timeout_s: float = 150.0) -> dict:
    """``autopar run ARGS --json``: asserts success and that stdout is exactly one JSON object."""
    proc = autopar_run(*args, "--json", env=env, timeout_s=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"stdout must be one JSON line, got: {proc.stdout[:2000]!r}"
    return json.loads(lines[0])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel_diff(a: list[float], b: list[float]) -> float:
    """Largest relative difference of two loss lists of equal length."""
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference() -> dict:
    """The one-process reference: every degree 1, 4 steps."""
    return run_json(MODEL, *BATCH, "--steps", "4")


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same 4 steps under dp=2 (DDP), run from a plan file (it brings split and batch)."""
    path = tmp_path_factory.mktemp("plans") / "dp2.json"
    write_cpu_plan(MODEL, path, dp=2, global_batch=4, dtype="fp32")
    return run_json(str(path), "--steps", "4")


@pytest.mark.timeout(180)
def test_one_process_reports_losses(reference: dict) -> None:
    assert set(reference) >= {"losses", "step_times_s", "peak_memory_bytes", "world_size",
                              "config"}
    assert reference["world_size"] == 1
    assert reference["config"]["dp"] == 1 and reference["config"]["dtype"] == "fp32"
    losses = reference["losses"]
    assert len(losses) == 4 and len(reference["step_times_s"]) == 4
    assert all(math.isfinite(x) for x in losses)
    # Next-token loss of a fresh model starts near ln(vocab) and training lowers it.
    assert abs(losses[0] - math.log(64)) < 0.2
    assert reference["peak_memory_bytes"] > 0
    assert all(t > 0 for t in reference["step_times_s"])


@pytest.mark.timeout(240)
def test_dp2_equals_one_process(reference: dict, dp2_run: dict) -> None:
    assert dp2_run["world_size"] == 2
    assert rel_diff(dp2_run["losses"][:3], reference["losses"][:3]) < 1e-3


@pytest.mark.timeout(400)
def test_resume_same_and_different_split(tmp_path: Path, reference: dict) -> None:
    ckpt = tmp_path / "ckpt"
    first = run_json(MODEL, *BATCH, "--steps", "2", "--checkpoint-dir", str(ckpt),
                     "--checkpoint-every", "1")
    assert first["losses"] == reference["losses"][:2]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_1", "step_2"]
    other = tmp_path / "ckpt_copy"
    shutil.copytree(ckpt, other)
    # What a crash mid-write leaves (a tmp dir; a dir without its manifest) is skipped.
    (ckpt / "step_3.tmp").mkdir()
    (ckpt / "step_4").mkdir()
    # Same split: continue up to step 4 (--steps is the total): exactly the uninterrupted losses.
    resumed = run_json(MODEL, *BATCH, "--steps", "4", "--checkpoint-dir", str(ckpt), "--resume")
    assert resumed["steps"] == [3, 4]
    assert resumed["losses"] == reference["losses"][2:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_1", "step_2", "step_4"]
    assert (ckpt / "step_4" / "MANIFEST.json").is_file()
    # Different split (one process -> tp=2): DCP reshards; equal up to fp32 rounding.
    resharded = run_json(MODEL, *BATCH, "--steps", "4", "--tp", "2", "--checkpoint-dir",
                         str(other), "--resume")
    assert resharded["steps"] == [3, 4] and resharded["world_size"] == 2
    assert rel_diff(resharded["losses"], reference["losses"][2:]) < 1e-5


@pytest.mark.timeout(400)
def test_a_tied_head_resumes_across_pipeline_splits(tmp_path: Path) -> None:
    """GPT-2's tied embedding and head: one weight in one process, two copies under pp (one
    rank each, or both on rank 0 under ZBV). A checkpoint of either resumes under the other
    with the uninterrupted losses: the head copy's optimizer state is stored under the
    embedding's name (runtime/checkpoint.py)."""
    tied = MODEL + ",tie_embeddings=true"
    whole = run_json(tied, *BATCH, "--steps", "4")["losses"]
    splits = {"one": (), "pp2": ("--pp", "2"),
              "zbv": ("--pp", "2", "--schedule", "zbv-zero-bubble", "--virtual-stages", "2")}
    for source, target in (("one", "pp2"), ("zbv", "one"), ("pp2", "zbv")):
        ckpt = tmp_path / f"{source}-{target}"
        first = run_json(tied, *BATCH, *splits[source], "--steps", "2", "--checkpoint-dir",
                         str(ckpt))
        assert rel_diff(first["losses"], whole[:2]) < 1e-5, (source, first["losses"], whole)
        resumed = run_json(tied, *BATCH, *splits[target], "--steps", "4", "--checkpoint-dir",
                           str(ckpt), "--resume")
        assert resumed["steps"] == [3, 4]
        assert rel_diff(resumed["losses"], whole[2:]) < 1e-5, (source, target, resumed, whole)


@pytest.mark.timeout(400)
def test_killed_worker_restarts_from_checkpoint(tmp_path: Path, dp2_run: dict) -> None:
    marker = tmp_path / "fault_marker"
    env = {"AUTOPAR_TEST_FAIL_AT": f"1:3:{marker}"}
    proc = autopar_run(MODEL, *BATCH, "--steps", "4", "--dp", "2", "--checkpoint-dir",
                       str(tmp_path / "ckpt"), "--checkpoint-every", "2", "--max-restarts", "1",
                       "--json", env=env, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists(), "the fault hook did not fire"
    assert "fault injected: rank 1 exits at step 3" in proc.stderr
    assert "training steps 3..4" in proc.stderr  # the restarted group resumed from step_2
    result = json.loads(proc.stdout)
    assert result["steps"] == [1, 2, 3, 4]
    assert result["losses"] == dp2_run["losses"]


@pytest.mark.timeout(400)
def test_two_launches_join_one_rendezvous(reference: dict) -> None:
    port = free_port()
    common = [MODEL, *BATCH, "--steps", "3", "--dp", "2", "--tp", "2", "--nnodes", "2",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen([sys.executable, "-m", "autopar.cli", "run", *common, "--node-rank",
                          str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=ROOT)
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=360)
            assert proc.returncode == 0, err[-3000:]
            outputs.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for result in outputs:
        assert result["world_size"] == 4
        assert rel_diff(result["losses"], reference["losses"][:3]) < 1e-3
    assert outputs[0]["losses"] == outputs[1]["losses"]
