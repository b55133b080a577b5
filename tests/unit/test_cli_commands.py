"""The autopar command line, run as a user runs it (subprocess), plus in-process error cases.

Subprocesses cost ~2-3 s of imports each, so only the flows whose streams matter (the document
alone on stdout, one-line errors, --debug tracebacks) run as subprocesses; the other error cases
call ``autopar.cli.main`` in the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tomllib
from report_fixtures import make_plan

from autopar.cli import main
from tests.helpers import one_error_line

TINY = "gpt:layers=4,hidden=64,heads=4,vocab=256,seq_len=32"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    one_error_line(proc.returncode, proc.stdout, proc.stderr, needle)


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(make_plan().to_json())
    return path


# ------------------------------------------------------------------ saved plans (no planner)
def test_show_prints_the_report_on_stdout(plan_file):
    proc = cli("show", str(plan_file))
    assert proc.returncode == 0, proc.stderr
    assert "Split  dp=2 tp=2 pp=2" in proc.stdout and "pipeline bubble" in proc.stdout
    assert proc.stderr == ""


def test_export_prints_only_the_document(plan_file):
    proc = cli("export", str(plan_file), "--to", "torchtitan")
    assert proc.returncode == 0, proc.stderr
    assert tomllib.loads(proc.stdout)["parallelism"]["pipeline_parallel_degree"] == 2


def test_missing_plan_file_is_one_line(tmp_path):
    assert_one_line_error(cli("show", str(tmp_path / "nope.json")), "does not exist")


def test_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = cli("show", str(bad), "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "PlanFormatError" in proc.stderr


def test_plan_file_errors_in_process(tmp_path, plan_file, capfd):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**make_plan().to_dict(), "schema_version": 99}))
    assert main(["show", str(old)]) == 2
    assert "schema_version 99 is not supported" in capfd.readouterr().err
    half = tmp_path / "half.json"
    half.write_text(json.dumps({"schema_version": 1, "config": {}}))
    assert main(["export", str(half), "--to", "megatron"]) == 2
    assert "malformed" in capfd.readouterr().err


def test_export_never_overwrites_without_force(tmp_path, plan_file, capfd):
    out = tmp_path / "ds.json"
    assert main(["export", str(plan_file), "--to", "torchtitan", "--out", str(out)]) == 0
    assert "global_batch_size = 16" in out.read_text()
    out.write_text("mine")
    assert main(["export", str(plan_file), "--to", "torchtitan", "--out", str(out)]) == 2
    assert "already exists; pass --force" in capfd.readouterr().err
    assert out.read_text() == "mine"
    assert main(["export", str(plan_file), "--to", "slurm", "--out", str(out), "--force"]) == 0
    assert out.read_text().startswith("#!/bin/bash")


def test_unwritable_output_is_an_error(plan_file, capfd):
    assert main(["export", str(plan_file), "--to", "megatron", "--out", "/nonexistent/x.sh"]) == 2
    assert "cannot write /nonexistent/x.sh" in capfd.readouterr().err


def test_show_plot_writes_a_png(tmp_path, plan_file, capfd):
    png = tmp_path / "p.png"
    assert main(["show", str(plan_file), "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")


# ------------------------------------------------------------------ cluster arguments
@pytest.mark.parametrize("argv,needle", [
    (["--gpus", "12"], "--gpus 12 does not fill nodes of 8 GPUs; use 8 or 16"),
    (["--gpus", "0"], "argument --gpus: must be from 1 to 1048576, got 0"),
    (["--gpus", "8", "--gpu", "tpu-v9"], "unknown cluster preset 'tpu-v9'"),
    ([], "say how many GPUs"),
])
def test_bad_gpu_counts(argv, needle, capfd):
    assert main(["plan", TINY, "--global-batch", "8", *argv]) == 2
    assert needle in capfd.readouterr().err


def test_a_split_that_does_not_fill_nodes_names_the_split_not_gpus(capfd):
    """Without cluster options the cluster is the split's GPUs: the error had blamed --gpus,
    which the user had not passed."""
    assert main(["estimate", TINY, "--global-batch", "12", "--pp", "4", "--dp", "3"]) == 2
    assert "the split's GPUs (dp*cp*tp*pp) 12 does not fill" in capfd.readouterr().err


def test_bad_cluster_yaml_names_the_field(tmp_path, capfd):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nnodes: 0\n")
    assert main(["plan", TINY, "--global-batch", "8", "--cluster", str(path)]) == 2
    assert capfd.readouterr().err == "autopar: error: cluster field nodes must be > 0, got 0\n"


def test_gpus_alone_means_nodes_of_eight():
    from autopar.cli.common import split_gpu_count

    assert split_gpu_count(1) == (1, 1) and split_gpu_count(8) == (1, 8)
    assert split_gpu_count(64) == (8, 8) and split_gpu_count(1024) == (128, 8)


# ------------------------------------------------------------------ with the planner
PLAN_ARGS = ("plan", TINY, "--gpus", "4", "--global-batch", "8", "--top-k", "2")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One real `autopar plan` run with --out and --plot, shared by the tests below."""
    folder = tmp_path_factory.mktemp("planned")
    out, png = folder / "p.json", folder / "p.png"
    proc = cli(*PLAN_ARGS, "--out", str(out), "--plot", str(png))
    return proc, out, png


def test_plan_report_out_and_plot(planned):
    proc, out, png = planned
    assert proc.returncode == 0, proc.stderr
    for needle in ("Split", "Where the step time goes", "Binding", "Per pipeline rank",
                   "Alternatives", "pure DP", "MFU"):
        assert needle in proc.stdout, needle
    assert json.loads(out.read_text())["model"] == TINY
    assert png.read_bytes().startswith(b"\x89PNG")


def test_plan_json_is_the_library_plan(planned):
    from autopar.cli.common import load_profile
    from autopar.cost_model.hardware import Cluster
    from autopar.search import plan  # autopar.plan's function (see the note in cmd_plan.py)

    proc = cli(*PLAN_ARGS, "--json")
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)  # the document alone: anything else breaks json.loads
    assert proc.stdout == planned[1].read_text()  # --json prints what --out writes
    profile = load_profile(TINY, None)
    cluster = Cluster.preset("a100-80g", nodes=1, gpus_per_node=4)
    best = plan(profile, cluster, global_batch=8, top_k=2, model=TINY)[0]
    assert proc.stdout == best.to_json()


def test_plan_never_overwrites_out_without_force(planned):
    before = planned[1].read_text()
    assert_one_line_error(cli(*PLAN_ARGS, "--out", str(planned[1])),
                          "already exists; pass --force")
    assert planned[1].read_text() == before


def test_explain_checks_the_model_fingerprint(planned):
    other = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq_len=32"
    proc = cli("explain", str(planned[1]), "--model", other)
    assert_one_line_error(proc, "made for another model")


def test_unknown_model_suggests_close_names():
    assert_one_line_error(cli("plan", "gpt3-175", "--gpus", "8", "--global-batch", "8"),
                          "Did you mean")


def test_infeasible_model_says_what_it_needs():
    big = "gpt:layers=2,hidden=4096,heads=32,vocab=50304,seq_len=2048"
    proc = cli("plan", big, "--gpus", "1", "--gpu-memory", "1", "--global-batch", "8")
    assert_one_line_error(proc, "")
    assert "GiB" in proc.stderr


def test_estimate_json_and_bad_batch(capfd):
    proc = cli("estimate", TINY, "--dp", "2", "--tp", "2", "--global-batch", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["config"]["dp"], doc["config"]["tp"]) == (2, 2)
    assert doc["estimate"]["step_time_s"] > 0 and doc["model"] == TINY
    assert main(["estimate", TINY, "--dp", "3", "--global-batch", "8"]) == 2
    assert "not divisible" in capfd.readouterr().err


def test_sweep_json_marks_a_pareto_front():
    proc = cli("sweep", TINY, "--gpus", "2,4", "--gpu", "a100-80g,h100", "--tokens", "1e9",
               "--global-batch", "8", "--price-per-gpu-hour", "a100-80g=2,h100=4",
               "--time-budget", "20", "--json")
    assert proc.returncode == 0, proc.stderr
    points = json.loads(proc.stdout)
    assert len(points) == 4 and any(p["pareto"] for p in points)
    assert all(p["cost"] > 0 and p["days"] > 0 for p in points if not p["error"])


def test_sweep_points_without_a_plan_have_no_figures(capfd):
    """A point with no plan reports null figures, not 0 days (the fastest to a sort); a sweep
    where no point has one fails, as plan does."""
    argv = ["sweep", TINY, "--gpus", "2,4", "--tokens", "1e9", "--global-batch", "8", "--json"]
    assert main([*argv, "--gpu-memory", "0.001"]) == 2
    out, err = capfd.readouterr()
    points = json.loads(out)
    assert all(p["error"] and p["days"] is None and p["gpu_hours"] is None for p in points)
    assert err.splitlines()[-1].startswith("autopar: error: no point of the sweep has a plan")
    assert main(argv) == 0
    assert all(p["days"] > 0 for p in json.loads(capfd.readouterr().out))


def test_presets_json():
    proc = cli("presets", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert "gpt3-175b" in doc["models"] and "h100" in doc["clusters"]
