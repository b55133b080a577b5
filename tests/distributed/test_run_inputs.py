"""``autopar run``: bad inputs end with one line and exit code 2 before any worker starts;
``--dry-run`` applies a plan at world size 8 on a fake process group.

Most cases call ``autopar.cli.cmd_run.main`` in this process (no launch happens for bad input);
one case and the dry run go through the CLI in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from autopar.cli.cmd_run import main
from autopar.runtime.manifest import write_manifest
from tests.helpers import one_error_line, write_cpu_plan
from tests.processes import run_autopar

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
MODEL = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq_len=16"
OTHER_MODEL = "gpt:layers=3,hidden=32,heads=4,vocab=64,seq_len=16"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_autopar("run", *args, timeout_s=120)


@pytest.fixture(scope="module")
def dp2_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan file for MODEL at dp=2 on a 2-process CPU cluster."""
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    return write_cpu_plan(MODEL, path, dp=2, global_batch=4, dtype="fp32")


def _expect_error(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> str:
    return one_error_line(main(argv), *capsys.readouterr(), needle)


@pytest.mark.timeout(120)
def test_world_size_mismatch(capsys: pytest.CaptureFixture[str], dp2_plan: Path) -> None:
    _expect_error(capsys, [str(dp2_plan), "--steps", "1", "--nproc-per-node", "1"],
                  "the plan needs 2 processes but the launch has 1 node(s) x 1")
    _expect_error(capsys, [str(dp2_plan), "--steps", "1", "--nnodes", "4", "--node-rank", "1",
                           "--rdzv-endpoint", "127.0.0.1:29999"],
                  "the plan needs 2 processes")


@pytest.mark.timeout(120)
def test_plan_for_another_model(capsys: pytest.CaptureFixture[str], dp2_plan: Path) -> None:
    _expect_error(capsys, [str(dp2_plan), "--model", OTHER_MODEL, "--steps", "1"],
                  "was made for another model")


@pytest.mark.timeout(120)
def test_plan_with_split_flags(capsys: pytest.CaptureFixture[str], dp2_plan: Path) -> None:
    _expect_error(capsys, [str(dp2_plan), "--tp", "2", "--steps", "1"],
                  "brings its own split")


@pytest.mark.timeout(120)
def test_checkpoint_dirs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    base = [MODEL, "--global-batch", "4", "--steps", "2"]
    _expect_error(capsys, [*base, "--checkpoint-dir", str(tmp_path / "missing"), "--resume"],
                  "does not exist; nothing to resume")
    used = tmp_path / "used"
    (used / "step_1").mkdir(parents=True)
    _expect_error(capsys, [*base, "--checkpoint-dir", str(used)], "pass --resume")
    _expect_error(capsys, [*base, "--checkpoint-dir", str(used), "--resume"],
                  "holds no complete checkpoint")
    for step in (1, 5):
        (used / f"step_{step}").mkdir(exist_ok=True)
        (used / f"step_{step}" / ".metadata").write_bytes(b"metadata")
        write_manifest(used / f"step_{step}", {"step": step})
    _expect_error(capsys, [*base, "--checkpoint-dir", str(used), "--resume"],
                  "at step 5, past --steps 2")
    _expect_error(capsys, [*base, "--resume"], "--resume needs --checkpoint-dir")


@pytest.mark.timeout(120)
def test_impossible_split(capsys: pytest.CaptureFixture[str]) -> None:
    _expect_error(capsys, [MODEL, "--global-batch", "4", "--steps", "1", "--tp", "3"],
                  "must divide")
    _expect_error(capsys, [MODEL, "--global-batch", "3", "--steps", "1", "--dp", "2"],
                  "not divisible")
    _expect_error(capsys, [MODEL, "--steps", "1"], "--global-batch")


@pytest.mark.timeout(120)
def test_cli_bad_input_has_no_traceback(tmp_path: Path) -> None:
    proc = _cli(MODEL, "--global-batch", "4", "--steps", "1", "--checkpoint-dir",
                str(tmp_path / "nope"), "--resume", "--json")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "nothing to resume" in proc.stderr


@pytest.mark.timeout(180)
def test_dry_run_at_world_size_8() -> None:
    from autopar.models import build, num_params

    proc = _cli("gpt:layers=4,hidden=32,heads=4,vocab=64,seq_len=16", "--global-batch", "8",
                "--steps", "1", "--dp", "4", "--pp", "2", "--zero", "3",
                "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["world_size"] == 8
    sizes = report["per_rank_parameter_bytes"]
    assert len(sizes) == 8 and all(s > 0 for s in sizes)
    # pp splits the layers and FSDP (zero 3) shards every parameter over dp=4 (all dims here
    # divide by 4): the ranks together hold each fp32 parameter exactly once.
    model = build("gpt", layers=4, hidden=32, heads=4, vocab=64, seq_len=16)
    assert sum(sizes) == 4 * num_params(model.autopar_spec)
    # Ranks 0-3 run stage 0, ranks 4-7 stage 1 (pp is the outermost mesh axis).
    assert report["per_rank_stages"] == [[0]] * 4 + [[1]] * 4


@pytest.mark.timeout(180)
def test_dry_run_of_replicated_data_parallel() -> None:
    """zero 0 (DDP, which cannot be built on the meta device) dry-runs: every rank holds the
    whole model."""
    from autopar.models import build, num_params

    proc = _cli(MODEL, "--global-batch", "4", "--steps", "1", "--dp", "2", "--zero", "0",
                "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    model = build("gpt", layers=2, hidden=32, heads=4, vocab=64, seq_len=16)
    assert report["per_rank_parameter_bytes"] == [4 * num_params(model.autopar_spec)] * 2


@pytest.mark.timeout(60)
def test_live_tensor_bytes_counts_storages_once() -> None:
    import gc

    import torch

    from autopar.runtime.worker import LiveTensorBytes

    mib = 1 << 20
    tracker = LiveTensorBytes()
    with tracker:
        x = torch.zeros(mib, dtype=torch.uint8)
        view = x.view(1024, 1024)  # a view shares the storage: not counted again
        x.untyped_storage()  # a new Python handle of the same storage: not counted again
        gc.collect()
        assert tracker.current_bytes == mib
        y = view * 2  # a new storage
        assert tracker.current_bytes == 2 * mib
        del x, view
        gc.collect()
        assert tracker.current_bytes == mib
        del y
        gc.collect()
    assert tracker.current_bytes == 0
    assert tracker.peak_bytes == 2 * mib


@pytest.mark.timeout(120)
def test_dry_run_of_a_model_file() -> None:
    model_file = ROOT / "tests" / "fixtures" / "models" / "tiny_mlp.py"
    proc = _cli(str(model_file), "--global-batch", "4", "--steps", "1", "--dp", "2", "--zero",
                "3", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    from autopar.models import load_model_file

    model = load_model_file(model_file).build_model()
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # FSDP (zero 3) over dp=2 holds every parameter exactly once across the two ranks.
    assert report["world_size"] == 2
    assert sum(report["per_rank_parameter_bytes"]) == total_bytes
    assert report["per_rank_parameter_bytes"][0] < total_bytes


@pytest.mark.timeout(60)
def test_model_split_does_not_fill_the_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    _expect_error(capsys, [MODEL, "--global-batch", "4", "--steps", "1", "--dp", "2", "--nnodes",
                           "3", "--rdzv-endpoint", "127.0.0.1:29999"],
                  "the plan needs 2 processes but the launch has 3 node(s)")


@pytest.mark.timeout(120)
def test_a_plan_is_read_by_its_content_whatever_its_name(tmp_path) -> None:
    """`run` took only `*.json` files for plans (show and export take any name): `p.plan`
    had been asked for a global batch, as a model; a plan's NaN is refused as show refuses it."""
    from autopar.cli import main

    plan = tmp_path / "p.json"
    assert main(["plan", "gpt:layers=2,hidden=64,heads=4,vocab=256,seq_len=32", "--gpus", "2",
                 "--gpu", "cpu", "--global-batch", "4", "--out", str(plan)]) == 0
    renamed = tmp_path / "p.PLAN"
    renamed.write_text(plan.read_text())
    proc = _cli(str(renamed), "--steps", "1", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["world_size"] == 2
    nan = tmp_path / "nan.json"
    nan.write_text(plan.read_text().replace('"mip_gap": ', '"mip_gap": NaN, "x": ', 1))
    proc = _cli(str(nan), "--steps", "1", "--dry-run")
    assert proc.returncode == 2 and "plan holds NaN" in proc.stderr, proc.stderr[-3000:]
