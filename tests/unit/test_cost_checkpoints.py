"""Full recompute's saved block input split over tp and kept in host memory: DeepSpeed's
``partition-activations`` / ``cpu-checkpointing`` and Megatron-LM's
``distribute-saved-activations`` settings (cost_model/checkpoints.py)."""

from __future__ import annotations

import json

import pytest

from autopar import estimate
from autopar.config import ParallelConfig
from autopar.cost_model import comm
from autopar.cost_model.frameworks import framework_supports, get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.exporters import export_plan
from autopar.search import plan_from_config
from tests.unit.test_search_planner import gpt_profile

PROFILE = gpt_profile(4, 1024, 16, s=1024)
V100 = Cluster.preset("v100-32g", nodes=2, gpus_per_node=4)
PARTITIONED = "deepspeed+partition-activations"
OFFLOADED = "deepspeed+partition-activations+cpu-checkpointing"


def _cfg(**kw) -> ParallelConfig:
    base = dict(dp=2, tp=4, zero=1, recompute="full", global_batch=8, micro_batch=2,
                dtype="fp16")
    return ParallelConfig(**{**base, **kw})


def _block(framework: str, cfg: ParallelConfig):
    return build_cost_table(PROFILE, V100, cfg, framework).layers[1]


def test_partitioned_checkpoint_keeps_a_tp_share_and_gathers_it_before_the_rerun():
    cfg = _cfg()
    plain, part = _block("deepspeed", cfg), _block(PARTITIONED, cfg)
    whole = plain.act_bytes[2]
    assert whole > 0
    assert part.act_bytes[2] == pytest.approx(whole / cfg.tp)
    assert part.act_bytes[:2] == plain.act_bytes[:2]  # only the full mode keeps less
    # The gathered input lives while the block re-runs.
    assert part.transient_bytes[2] > plain.transient_bytes[2]
    # One all-gather of the whole input over tp, waited for, in the full mode only.
    tp_link = comm.parallel_groups(V100, cfg)["tp"]
    whole_input = 2 * cfg.micro_batch * PROFILE.seq_len * PROFILE.hidden  # fp16 [b, s, h]
    assert part.tp_comm_s[2] - plain.tp_comm_s[2] == pytest.approx(
        comm.all_gather_s(tp_link, whole_input), rel=0.05)
    assert part.tp_comm_s[:2] == plain.tp_comm_s[:2]
    assert part.recompute_s == plain.recompute_s  # no host copies


def test_cpu_checkpointing_keeps_no_input_on_the_device_and_pays_two_host_copies():
    cfg = _cfg()
    part, off = _block(PARTITIONED, cfg), _block(OFFLOADED, cfg)
    assert off.act_bytes[2] == 0.0
    share = part.act_bytes[2] / 1.07  # the allocator's fragmentation share removed
    copies = 2 * share / V100.pcie_bytes_per_s
    assert off.recompute_s[2] - part.recompute_s[2] == pytest.approx(copies, rel=0.05)
    assert off.host_bytes - part.host_bytes == pytest.approx(share * cfg.pp, rel=0.05)
    assert off.tp_comm_s == part.tp_comm_s


def test_at_tp_1_partitioning_changes_nothing_but_offload_still_moves_the_input():
    cfg = _cfg(dp=8, tp=1, global_batch=16)
    plain, part, off = (_block(f, cfg) for f in ("deepspeed", PARTITIONED, OFFLOADED))
    assert part.act_bytes == plain.act_bytes and part.tp_comm_s == plain.tp_comm_s
    assert off.act_bytes[2] == 0.0 and off.recompute_s[2] > plain.recompute_s[2]


def test_a_split_that_does_not_fit_whole_inputs_fits_with_them_partitioned_or_offloaded():
    big = gpt_profile(12, 8192, 64, s=1024)
    cfg = _cfg(dp=2, tp=4, micro_batch=48, global_batch=192, zero=3)
    mem = {f: estimate(big, V100, cfg, framework=f) for f in ("deepspeed", PARTITIONED,
                                                              OFFLOADED)}
    gib = {f: e.memory_per_gpu_bytes / 2**30 for f, e in mem.items()}
    assert gib["deepspeed"] > gib[PARTITIONED] > gib[OFFLOADED]
    assert not mem["deepspeed"].fits and mem[OFFLOADED].fits


def test_settings_require_what_their_frameworks_require():
    refused = framework_supports(get_framework("deepspeed+cpu-checkpointing"), _cfg())
    assert refused and "partition-activations" in refused
    megatron = get_framework("megatron-lm+distribute-saved-activations")
    assert framework_supports(megatron, _cfg(zero=1, dtype="bf16")) is None
    assert "sequence" in framework_supports(megatron, _cfg(sequence_parallel=True))
    assert "tp > 1" in framework_supports(megatron, _cfg(dp=8, tp=1, global_batch=16))
    # Megatron-LM's setting is the same mechanism, costed alike.
    cfg = _cfg(dtype="bf16")
    assert _block("megatron-lm+distribute-saved-activations", cfg).act_bytes[2] == (
        pytest.approx(_block("megatron-lm", cfg).act_bytes[2] / 4))


def test_exports_write_what_the_prediction_assumed():
    cfg = _cfg()
    for spec, partitioned, offloaded in (("deepspeed", False, False),
                                         (PARTITIONED, True, False), (OFFLOADED, True, True)):
        plan = plan_from_config(PROFILE, V100, cfg, framework=spec)
        doc = json.loads(export_plan(plan, "deepspeed").text)
        assert doc["activation_checkpointing"]["partition_activations"] is partitioned
        assert doc["activation_checkpointing"]["cpu_checkpointing"] is offloaded
    spec = "megatron-lm+distribute-saved-activations"
    full = plan_from_config(PROFILE, V100, _cfg(dtype="bf16"), framework=spec)
    assert "--distribute-saved-activations" in export_plan(full, "megatron").text
    none = plan_from_config(PROFILE, V100, _cfg(dtype="bf16", recompute="none"), framework=spec)
    out = export_plan(none, "megatron")
    assert "--distribute-saved-activations" not in out.text
    assert any("distribute-saved-activations" in note for note in out.notes)


def test_cli_estimate_reports_the_checkpoints_host_memory_and_refuses_what_deepspeed_refuses(
        capsys):
    from autopar.cli import main

    args = ["estimate", "gpt:layers=4,hidden=1024,heads=16,seq_len=1024,vocab=1024", "--gpus",
            "8", "--gpu", "v100-32g", "--dp", "2", "--tp", "4", "--micro-batch", "2",
            "--global-batch", "8", "--recompute", "full", "--zero", "1", "--dtype", "fp16"]
    assert main([*args, "--framework", OFFLOADED]) == 0
    assert "(activation checkpoints; fits)" in capsys.readouterr().out
    assert main([*args, "--framework", "deepspeed+cpu-checkpointing"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopar: error:") and (
        "partition-activations" in err[0])
