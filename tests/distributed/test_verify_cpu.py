"""``autopar verify`` on a tiny 2-process plan: predicted and measured figures, per-rank memory
(global rank to pipeline rank as the runtime's mesh lays them out), and the refit."""

from __future__ import annotations

import argparse
import json

import pytest

from autopar.cli.cmd_verify import add_verify_arguments, verify_command
from autopar.config import ParallelConfig
from autopar.cost_model.hardware import Cluster
from autopar.errors import AutoparError
from autopar.runtime.verify import pp_rank_of

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq_len=16"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_verify_arguments(parser)
    return parser.parse_args(list(argv))


def _plan_file(tmp_path) -> str:
    """A 2-layer GPT over 2 pipeline ranks (2 micro-batches: the stages' memory differs)."""
    from autopar.runtime.verify import model_profile
    from autopar.search.planner import plan_from_config

    cluster = Cluster.preset("cpu", gpus_per_node=2)
    config = ParallelConfig(pp=2, micro_batch=2, global_batch=4, dtype="fp32")
    plan = plan_from_config(model_profile(MODEL), cluster, config, model=MODEL)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    return str(path)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_verify_reports_prediction_and_measurement_and_refits(tmp_path, capfd):
    plan_path = _plan_file(tmp_path)
    out = tmp_path / "refit.yaml"
    code = verify_command(_args(plan_path, "--steps", "3", "--warmup", "1", "--refit",
                                "--out", str(out), "--json"))
    assert code == 0
    captured = capfd.readouterr()
    record = json.loads(captured.out)
    capfd_text = captured.err
    assert record["predicted_step_time_s"] > 0 and record["measured_step_time_s"] > 0
    assert len(record["step_times_s"]) == 3
    per_rank = record["per_rank"]
    assert [(row["rank"], row["pp_rank"]) for row in per_rank] == [(0, 0), (1, 1)]
    predicted = {st["rank"]: sum(st["memory"].values()) for st in record["estimate"]["stages"]}
    assert predicted[0] != predicted[1]
    assert [row["predicted_bytes"] for row in per_rank] == [predicted[0], predicted[1]]
    assert max(row["measured_bytes"] for row in per_rank) == record["measured_memory_bytes"]
    for row in per_rank:
        assert row["error"] == pytest.approx(
            (row["predicted_bytes"] - row["measured_bytes"]) / row["measured_bytes"])
    # Each parameter lives on one pipeline rank; the ranks' live tensor bytes together hold at
    # least the fp32 parameters, gradients and Adam state (16 B/param).
    num_params = 2 * (12 * 32 * 32 + 13 * 32) + 64 * 32 + 16 * 32 + 2 * 32
    assert sum(row["measured_bytes"] for row in per_rank) >= 16 * num_params * 0.9
    table = capfd_text.splitlines()
    header = table.index("     rank  pp rank   predicted    measured    error")
    assert [line.split()[:2] for line in table[header + 1:header + 3]] == [["0", "0"], ["1", "1"]]
    error = record["step_time_error"]
    assert error == pytest.approx(
        (record["predicted_step_time_s"] - record["measured_step_time_s"])
        / record["measured_step_time_s"])
    # The refit moves the compute throughput toward the measurement.
    base = Cluster.preset("cpu", gpus_per_node=2)
    new = Cluster.from_yaml(out)
    old_rate = base.device.peak_fp32_flops * base.device.matmul_efficiency_max
    new_rate = new.device.peak_fp32_flops * new.device.matmul_efficiency_max
    assert (new_rate < old_rate) == (error < 0)
    assert record["refit_cluster"] == new.to_dict()


@pytest.mark.distributed
@pytest.mark.parametrize("pp,dp,tp", [(2, 3, 2), (4, 1, 2), (3, 2, 1)])
def test_pp_rank_matches_the_runtime_mesh(pp, dp, tp):
    """pp_rank_of agrees with build_mesh's layout (a fake process group: no processes)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.runtime.mesh import build_mesh

    config = ParallelConfig(pp=pp, dp=dp, tp=tp, global_batch=dp)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=config.world_size)
    try:
        layout = build_mesh(config, "cpu").mesh  # global rank at each (pp, dp, tp) coordinate
    finally:
        dist.destroy_process_group()
    for pp_coordinate in range(pp):
        for rank in layout[pp_coordinate].flatten().tolist():
            assert pp_rank_of(rank, config.to_dict()) == pp_coordinate


def test_verify_refit_needs_out_and_never_overwrites(tmp_path):
    with pytest.raises(AutoparError, match="--out"):
        verify_command(_args("plan.json", "--refit"))
    existing = tmp_path / "c.yaml"
    existing.write_text("keep")
    with pytest.raises(AutoparError, match="--force"):
        verify_command(_args("plan.json", "--refit", "--out", str(existing)))
    assert existing.read_text() == "keep"
    with pytest.raises(AutoparError, match=r"missing\.json does not exist"):
        verify_command(_args(str(tmp_path / "missing.json")))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_verify_predicts_a_plan_whose_cpu_profile_differs(tmp_path, capfd):
    """A llama plan is made with the GPU kernels' saved tensors (as ``autopar plan`` counts
    them); on CPU verify re-profiles the same model with the CPU kernels', whose fingerprint
    differs (an unfused RMSNorm keeps its input), and predicts with that profile on purpose."""
    from autopar.runtime.verify import model_profile
    from autopar.search.planner import plan_from_config

    model = "llama:layers=2,hidden=32,heads=2,kv_heads=1,vocab=64,seq_len=16"
    assert model_profile(model).fingerprint() != model_profile(model, kernels="cpu").fingerprint()
    cluster = Cluster.preset("cpu", gpus_per_node=2)
    config = ParallelConfig(dp=2, global_batch=4, dtype="fp32")
    plan = plan_from_config(model_profile(model), cluster, config, model=model)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert verify_command(_args(str(path), "--steps", "2", "--warmup", "1", "--json")) == 0
    record = json.loads(capfd.readouterr().out)
    assert record["predicted_step_time_s"] > 0 and record["measured_step_time_s"] > 0
