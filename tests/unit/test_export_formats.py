"""Exporters: each tool's document parses and carries the keys that tool reads."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess

import pytest
import tomllib
from report_fixtures import make_plan

from autopar.cost_model.held_counts import splits_backward
from autopar.exporters import TORCHTITAN_SCHEDULES, export_plan, to_slurm

SCHEDULE_CASES = [
    ("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zero-bubble", 2),
    ("zbv-zero-bubble", 2), ("dualpipe-v", 2),
]


def _flags(text: str) -> dict[str, str | bool]:
    """Megatron flags text -> {flag: value or True}."""
    words = shlex.split(text.replace("\\\n", " "))
    out: dict[str, str | bool] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else "--"
            out[word] = True if nxt.startswith("--") else nxt
    return out


@pytest.mark.parametrize("schedule,virtual", SCHEDULE_CASES)
def test_torchtitan_parallelism_keys_and_schedule_names(schedule, virtual):
    # a schedule that splits backwards recomputes nothing (framework_support.
    # split_recompute_refusal)
    mode = "none" if splits_backward(schedule) else "selective"
    plan = make_plan(schedule=schedule, virtual_stages=virtual, recompute=mode)
    doc = tomllib.loads(export_plan(plan, "torchtitan").text)
    par = doc["parallelism"]
    assert par["pipeline_parallel_schedule"] == TORCHTITAN_SCHEDULES[schedule]
    assert par["pipeline_parallel_degree"] == 2 and par["tensor_parallel_degree"] == 2
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == 2
    assert par["pipeline_parallel_microbatch_size"] == 1
    assert par["enable_async_tensor_parallel"] is False
    # every stage's torchtitan modules, in stage order: the plan's own split
    parts = par["module_fqns_per_model_part"]
    assert len(parts) == 2 * virtual
    assert [m for part in parts for m in part] == [
        "tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]
    assert doc["activation_checkpoint"]["mode"] == mode
    train = doc["training"]
    assert train["global_batch_size"] == 16 and train["local_batch_size"] == 8
    assert train["seq_len"] == 32 and train["mixed_precision_param"] == "bfloat16"


@pytest.mark.parametrize("zero,replicate,shard,reshard", [
    (0, 4, 1, "never"), (1, 1, 4, "never"), (2, 1, 4, "never"), (3, 1, 4, "always"),
])
def test_torchtitan_zero_stages_map_to_ddp_or_fsdp(zero, replicate, shard, reshard):
    plan = make_plan(dp=4, tp=1, pp=1, schedule="1f1b", virtual_stages=1, zero=zero,
                     recompute="full", sequence_parallel=False)
    doc = tomllib.loads(export_plan(plan, "torchtitan").text)
    par = doc["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (
        replicate, shard)
    assert par["fsdp_reshard_after_forward"] == reshard
    assert "module_fqns_per_model_part" not in par
    assert doc["activation_checkpoint"]["mode"] == "full"


def test_megatron_flags_interleaved_plan():
    plan = make_plan()
    flags = _flags(export_plan(plan, "megatron").text)
    assert flags["--tensor-model-parallel-size"] == "2"
    assert flags["--pipeline-model-parallel-size"] == "2"
    # the plan's chunks hold 1, 1, 2 and 0 blocks (the head alone on the last): Megatron's
    # layout sets them stage by stage (layout index j runs on rank j % pp, as autopar places it)
    assert flags["--pipeline-model-parallel-layout"] == "Et*1|t*1|t*2|L"
    assert "--num-layers-per-virtual-pipeline-stage" not in flags
    assert flags["--micro-batch-size"] == "1" and flags["--global-batch-size"] == "16"
    assert flags["--recompute-granularity"] == "selective"
    assert "--recompute-method" not in flags
    assert flags["--sequence-parallel"] is True and flags["--use-distributed-optimizer"] is True
    assert flags["--bf16"] is True


def test_megatron_counts_the_blocks_of_a_hugging_face_plan():
    """A Hugging Face decoder's blocks are named by module (``model.layers.<i>``): the layout
    counts them as the zoo's ``layers.<i>``."""
    plan = make_plan()
    stages = tuple(dataclasses.replace(s, layer_names=tuple(
        "model." + n if n.startswith("layers.") else n for n in s.layer_names))
        for s in plan.stages)
    flags = _flags(export_plan(dataclasses.replace(plan, stages=stages), "megatron").text)
    assert flags["--pipeline-model-parallel-layout"] == "Et*1|t*1|t*2|L"


def test_megatron_flags_full_recompute_no_pipeline():
    plan = make_plan(dp=4, tp=1, pp=1, schedule="1f1b", virtual_stages=1, zero=0,
                     recompute="full", sequence_parallel=False, dtype="fp32")
    flags = _flags(export_plan(plan, "megatron").text)
    assert flags["--recompute-granularity"] == "full"
    assert flags["--recompute-method"] == "uniform"
    for absent in ("--num-layers-per-virtual-pipeline-stage", "--sequence-parallel",
                   "--use-distributed-optimizer", "--bf16", "--fp16"):
        assert absent not in flags


@pytest.mark.parametrize("zero,pp", [(0, 2), (1, 2), (3, 1)])
def test_deepspeed_batch_identity_and_zero_stage(zero, pp):
    # DeepSpeed's pipeline engine runs 1F1B with ZeRO-1 at most (frameworks.py).
    plan = make_plan(zero=zero, pp=pp, dp=4 // pp, schedule="1f1b", virtual_stages=1,
                     sequence_parallel=False)
    doc = json.loads(export_plan(plan, "deepspeed").text)
    cfg = plan.config
    assert doc["train_batch_size"] == (
        doc["train_micro_batch_size_per_gpu"] * doc["gradient_accumulation_steps"] * cfg.dp)
    assert doc["zero_optimization"]["stage"] == zero
    assert doc["bf16"]["enabled"] is True and doc["fp16"]["enabled"] is False
    assert "stages" not in doc.get("pipeline", {})  # DeepSpeed ignores it (export_rules)
    assert doc["tensor_parallel"]["autotp_size"] == 2


@pytest.mark.parametrize("fields,why", [
    ({}, "interleaved-1f1b"),  # the default fixture plan is interleaved
    ({"zero": 3, "schedule": "1f1b", "virtual_stages": 1, "sequence_parallel": False},
     "without pipeline parallelism"),
])
def test_deepspeed_refuses_what_its_engine_cannot_run(fields, why):
    with pytest.raises(ValueError, match=why):
        export_plan(make_plan(**fields), "deepspeed")


def test_slurm_script_runs_autopar_run_on_every_node():
    plan = make_plan(dp=16, tp=2, pp=2)
    plan = type(plan).from_dict({**plan.to_dict(), "cluster": {"nodes": 8, "gpus_per_node": 8}})
    text = to_slurm(plan, plan_path="my plan.json", steps=7).text
    assert "#SBATCH --nodes=8" in text and "#SBATCH --gpus-per-node=8" in text
    assert "srun" in text and "--rdzv-endpoint" in text and "--nnodes 8" in text
    assert "--nproc-per-node 8" in text and '--node-rank "$SLURM_NODEID"' in text
    assert "autopar run \"$AUTOPAR_PLAN\"" in text and "--steps 7" in text
    assert "export AUTOPAR_PLAN='my plan.json'" in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True, timeout=30)


def test_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="unknown export format"):
        export_plan(make_plan(), "jax")
