"""``autopar run`` with the dimensions beyond dp x tp x pp: a plan JSON with cp, HSDP and offload.

One 4-process launch of a plan file (HSDP 2 replicas x (dp_shard 1 x cp 2) shards, FSDP2 zero 3
with ``offload="params"``, cp = 2) against a one-process launch of the same model and batch: the
losses of 3 AdamW steps agree to 1e-3 (relative). The flags' bad inputs end with one
``autopar: error:`` line and exit code 2.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_run_train import autopar_run, rel_diff, run_json

pytestmark = pytest.mark.distributed

MODEL = "llama:layers=2,hidden=32,heads=4,kv_heads=2,vocab=64,seq_len=16"


def _plan_file(tmp_path: Path) -> Path:
    """A plan for the model with dp=2 (HSDP 2 x 1), cp=2, zero 3, offload params, fp32.

    The stages come from ``plan_from_config`` for dp=4 on the same 4 processes (pp = tp = 1
    either way); the runtime does not read the estimate, which is left empty (it was made for
    that other split).
    """
    import autopar
    from autopar.cost_model.estimate import Estimate, MemoryBreakdown, TimeBreakdown
    from autopar.cost_model.hardware import Cluster
    from autopar.runtime.worker import build_model
    from autopar.search.planner import plan_from_config

    profile = autopar.profile(build_model(MODEL, device="meta"))
    base = autopar.ParallelConfig(dp=4, zero=3, global_batch=4, dtype="fp32")
    plan = plan_from_config(profile, Cluster.preset("cpu", gpus_per_node=4), base, model=MODEL)
    config = dataclasses.replace(base, dp=2, cp=2, dp_replicate=2, offload="params")
    empty = Estimate(
        step_time_s=0.0, tokens_per_s=0.0, tflops_per_gpu=0.0, hardware_tflops_per_gpu=0.0,
        mfu=0.0, memory_per_gpu_bytes=0.0, memory_capacity_bytes=0.0, fits=True,
        time_breakdown=TimeBreakdown(), memory_breakdown=MemoryBreakdown(),
    )
    path = tmp_path / "hsdp_cp_offload.json"
    path.write_text(dataclasses.replace(plan, config=config, estimate=empty).to_json())
    return path


@pytest.mark.timeout(240)
def test_plan_with_cp_hsdp_offload_runs_equal_to_one_process(tmp_path: Path) -> None:
    reference = run_json(MODEL, "--global-batch", "4", "--steps", "3")
    run = run_json(str(_plan_file(tmp_path)), "--steps", "3")
    assert run["world_size"] == 4
    assert (run["config"]["cp"], run["config"]["dp_replicate"]) == (2, 2)
    assert run["config"]["offload"] == "params"
    assert rel_diff(run["losses"], reference["losses"]) < 1e-3


@pytest.mark.timeout(60)
def test_bad_dimension_flags_are_one_line_errors() -> None:
    proc = autopar_run(MODEL, "--global-batch", "4", "--steps", "1", "--dp", "2",
                       "--dp-replicate", "2")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error: "), proc.stderr
    assert "dp_replicate" in lines[0] and "zero" in lines[0]
