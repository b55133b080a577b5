"""``autopar verify``: per-rank memory: rank to pipeline rank, table and JSON (no runs)."""

from __future__ import annotations

import json

import pytest

from autopar.runtime.verify import (
    Measurement,
    RankMemory,
    Verification,
    format_rank_table,
    format_verification,
    per_rank_memory,
    pp_rank_of,
)

MIB = 2**20


def _estimate(stage_mib: list[float]) -> dict:
    """An Estimate dict with one stage per pipeline rank, all of its bytes in parameters."""
    stages = [
        {"rank": i, "stages": [i], "layers": [[i, i]], "num_params": 1,
         "time_per_microbatch_s": 1e-3,
         "memory": {"parameters_bytes": mib * MIB / 2, "activations_bytes": mib * MIB / 2}}
        for i, mib in enumerate(stage_mib)
    ]
    return {"time_breakdown": {"compute_s": 2e-3}, "stages": stages,
            "memory_per_gpu_bytes": max(stage_mib) * MIB}


def _verification(config: dict, stage_mib: list[float], measured_mib: list[float]) -> Verification:
    measured = tuple(int(x * MIB) for x in measured_mib)
    estimate = _estimate(stage_mib)
    measurement = Measurement(step_times_s=(0.02, 0.01, 0.012), warmup_steps=1,
                              peak_memory_bytes=max(measured), losses=(4.0, 3.9, 3.8),
                              peak_memory_bytes_per_rank=measured)
    return Verification(
        config=config, predicted_step_time_s=0.01, measured_step_time_s=0.011,
        predicted_memory_bytes=estimate["memory_per_gpu_bytes"],
        measured_memory_bytes=max(measured), measurement=measurement, estimate=estimate,
        cluster_name="cpu", per_rank=per_rank_memory(config, estimate, measured),
    )


def test_pp_rank_is_the_outermost_mesh_coordinate():
    config = {"pp": 2, "dp": 3, "tp": 2}
    # Six ranks (dp x tp) per pipeline rank, consecutive.
    assert [pp_rank_of(r, config) for r in range(12)] == [0] * 6 + [1] * 6
    assert [pp_rank_of(r, {"pp": 4, "dp": 1, "tp": 1}) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="outside"):
        pp_rank_of(12, config)


def test_every_rank_gets_its_pipeline_ranks_prediction():
    v = _verification({"pp": 2, "dp": 2, "tp": 1}, [10.0, 6.0], [8.0, 9.0, 5.0, 4.0])
    assert [r.pp_rank for r in v.per_rank] == [0, 0, 1, 1]
    assert v.predicted_memory_bytes_per_rank == (10 * MIB, 10 * MIB, 6 * MIB, 6 * MIB)
    assert v.measured_memory_bytes_per_rank == (8 * MIB, 9 * MIB, 5 * MIB, 4 * MIB)
    assert v.memory_errors_per_rank == pytest.approx((0.25, 1 / 9, 0.2, 0.5))


def test_table_rows_under_the_existing_lines():
    v = _verification({"pp": 2, "dp": 1, "tp": 1}, [10.0, 6.0], [8.0, 5.0])
    lines = format_verification(v).splitlines()
    assert lines[2].lstrip().startswith("step time")
    assert lines[3].lstrip().startswith("peak memory ")
    header = lines.index("     rank  pp rank   predicted    measured    error")
    assert lines[header - 1].startswith("  peak memory per rank (MiB")
    assert lines[header + 1].split() == ["0", "0", "10.00", "8.00", "+25.0%"]
    assert lines[header + 2].split() == ["1", "1", "6.00", "5.00", "+20.0%"]
    assert len(lines) == header + 3


def test_table_caps_rows_and_sums_up_the_rest():
    measured = [10.0] * 20
    measured[18] = 20.0  # predicted 10: error -50%, the largest among the hidden ranks
    measured[17] = 9.0  # error +11.1%
    v = _verification({"pp": 1, "dp": 20, "tp": 1}, [10.0], measured)
    text = format_rank_table(v.per_rank, max_rows=16)
    lines = text.splitlines()
    assert len(lines) == 2 + 16 + 1
    assert lines[-2].split()[0] == "15"
    assert lines[-1] == "  ... 4 more ranks, largest error -50.0%"


def test_rank_without_a_measurement_has_no_error():
    row = RankMemory(rank=3, pp_rank=1, predicted_bytes=MIB, measured_bytes=0)
    assert row.error is None
    assert format_rank_table((row,)).splitlines()[-1].split()[-1] == "n/a"
    assert format_rank_table(()) == ""


def test_json_lists_every_rank():
    v = _verification({"pp": 2, "dp": 1, "tp": 2}, [10.0, 6.0], [8.0, 8.0, 4.0, 5.0])
    record = json.loads(json.dumps(v.to_dict()))
    assert record["per_rank"][2] == {"rank": 2, "pp_rank": 1, "predicted_bytes": 6.0 * MIB,
                                     "measured_bytes": 4 * MIB, "error": pytest.approx(0.5)}
    assert [row["rank"] for row in record["per_rank"]] == [0, 1, 2, 3]
    assert record["memory_error"] == pytest.approx(0.25)


def test_predict_profiles_the_model_at_the_plans_sequence_length():
    """A plan made with `autopar plan --seq-len` is predicted at that length (verify refused
    it: the model profiled at its own length has another fingerprint)."""
    from autopar.config import ParallelConfig
    from autopar.cost_model.hardware import Cluster
    from autopar.runtime.verify import model_profile, predict
    from autopar.search import plan_from_config

    model = "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,seq_len=32"
    cluster = Cluster.preset("cpu", gpus_per_node=2)
    plan = plan_from_config(model_profile(model, seq_len=64), cluster,
                            ParallelConfig(dp=2, global_batch=4), model=model)
    assert plan.seq_len == 64
    assert predict(plan, model, cluster).step_time_s > 0


def test_verify_notes_a_run_on_other_hardware_than_its_prediction():
    """On a machine without CUDA a plan for A100s runs on CPU processes: its error column
    compares two machines (-92% step, +11,900% memory had been shown without a word)."""
    import torch

    from autopar.cli.cmd_verify import _hardware_note
    from autopar.cost_model.hardware import Cluster

    assert _hardware_note(Cluster.preset("cpu", gpus_per_node=2)) == ""
    note = _hardware_note(Cluster.preset("a100-80g"))
    assert (note == "") == torch.cuda.is_available()
    if note:
        assert "A100" in note and "--cluster" in note
