"""Exports against the tools' own rules (export_rules: Megatron validate_args, DeepSpeed keys)."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import tomllib
from report_fixtures import make_plan

from autopar.export_rules import MegatronArgs, deepspeed_unknown_keys, megatron_violations
from autopar.exporters import export_plan, to_megatron

BOOL_FLAGS = {"--sequence-parallel": "sequence_parallel",
              "--use-distributed-optimizer": "distributed_optimizer",
              "--use-torch-fsdp2": "torch_fsdp2",
              "--untie-embeddings-and-output-weights": "untie_embeddings",
              "--bf16": "bf16", "--fp16": "fp16"}
INT_FLAGS = {"--num-layers-per-virtual-pipeline-stage": "layers_per_virtual",
             "--num-virtual-stages-per-pipeline-rank": "virtual_per_rank",
             "--decoder-first-pipeline-num-layers": "first_layers",
             "--decoder-last-pipeline-num-layers": "last_layers",
             "--recompute-num-layers": "recompute_num_layers"}

PLANS = {  # the four plans the exports are checked on
    "pp1": dict(dp=4, tp=1, pp=1, schedule="1f1b", virtual_stages=1, zero=0, recompute="full",
                sequence_parallel=False),
    "pp2-interleaved": {},
    "zero3": dict(dp=4, tp=1, pp=1, schedule="1f1b", virtual_stages=1, zero=3,
                  sequence_parallel=False),
    "tp2-pp2": dict(dp=2, tp=2, pp=2, schedule="1f1b", virtual_stages=1, zero=1,
                    recompute="full", sequence_parallel=False),
}


def parse_megatron(text: str, plan) -> MegatronArgs:
    """Exported flags -> the MegatronArgs they set (every flag must be one the rules know)."""
    words = shlex.split(text.replace("\\\n", " "))
    fields: dict = {"world_size": plan.config.world_size, "num_layers": 4}
    i = 0
    while i < len(words):
        flag = words[i]
        value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None
        i += 2 if value is not None else 1
        simple = {"--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp",
                  "--micro-batch-size": "micro_batch", "--global-batch-size": "global_batch"}
        if flag in simple:
            fields[simple[flag]] = int(value)
        elif flag in INT_FLAGS:
            fields[INT_FLAGS[flag]] = int(value)
        elif flag in BOOL_FLAGS:
            fields[BOOL_FLAGS[flag]] = True
        elif flag == "--no-gradient-accumulation-fusion":
            fields["gradient_accumulation_fusion"] = False
        elif flag == "--recompute-granularity":
            fields["recompute_granularity"] = value
        elif flag == "--recompute-method":
            fields["recompute_method"] = value
        elif flag == "--pipeline-model-parallel-layout":
            fields["layout"] = value
        else:
            assert flag == "--seq-length", f"unexpected flag {flag}"
    return MegatronArgs(**fields)


@pytest.mark.parametrize("name", ["pp1", "pp2-interleaved", "tp2-pp2"])
def test_megatron_export_passes_validate_args_rules(name):
    plan = make_plan(**PLANS[name])
    args = parse_megatron(export_plan(plan, "megatron").text, plan)
    assert megatron_violations(args) == []
    assert (args.tp, args.pp) == (plan.config.tp, plan.config.pp)
    if name == "pp2-interleaved":
        assert args.layout == "Et*1|t*1|t*2|L"  # the plan's own chunks, 1, 1, 2 and 0 blocks
    if plan.config.recompute == "full":
        assert (args.recompute_method, args.recompute_num_layers) == ("uniform", 1)


def test_megatron_zero3_is_refused_by_export_and_rewritten_by_the_exporter():
    plan = make_plan(**PLANS["zero3"])
    with pytest.raises(ValueError, match="megatron-lm runs ZeRO stages"):
        export_plan(plan, "megatron")
    out = to_megatron(plan)  # what Megatron would need: FSDP2 with its required flags
    args = parse_megatron(out.text, plan)
    assert args.torch_fsdp2 and not args.gradient_accumulation_fusion and args.untie_embeddings
    assert megatron_violations(args) == []
    assert any("--no-gradient-accumulation-fusion" in note for note in out.notes)


def test_megatron_zero3_with_a_pipeline_names_the_rule():
    plan = make_plan(dp=2, tp=2, pp=2, schedule="1f1b", virtual_stages=1, zero=3)
    with pytest.raises(ValueError, match="not supported with pipeline parallelism"):
        to_megatron(plan)


def test_megatron_drops_sequence_parallel_without_tensor_parallel():
    plan = make_plan(dp=4, tp=1, pp=1, schedule="1f1b", virtual_stages=1, zero=0,
                     sequence_parallel=True)
    out = to_megatron(plan)
    assert "--sequence-parallel" not in out.text
    assert any("sequence parallelism off" in note for note in out.notes)


@pytest.mark.parametrize("fields,rule", [
    (dict(world_size=6, tp=4, pp=1), "not divisible by tp\\*pp"),
    (dict(global_batch=6), "not divisible by --micro-batch-size"),
    (dict(sequence_parallel=True, tp=1), "needs --tensor-model-parallel-size > 1"),
    (dict(pp=2, layers_per_virtual=3), "not divisible by --num-layers-per-virtual"),
    (dict(pp=2, layers_per_virtual=1, first_layers=1), "cannot be used with"),
    (dict(world_size=4, pp=4, first_layers=1, last_layers=1, num_layers=7), "middle layers"),
    (dict(pp=2, layout="Et*2|t*1|t*1L"), "not divisible by pp=2"),
    (dict(pp=2, layout="Et*2|t*1"), "L last"),
    (dict(pp=2, layout="Et*2|t*1L"), "holds 3 blocks, not --num-layers 4"),
    (dict(pp=2, layout="Et*2|t*2L", first_layers=2), "excludes"),
    (dict(recompute_granularity="selective", recompute_method="uniform"), "selective"),
    (dict(recompute_granularity="full"), "--recompute-method"),
    (dict(torch_fsdp2=True), "--no-gradient-accumulation-fusion"),
    (dict(torch_fsdp2=True, gradient_accumulation_fusion=False), "--untie-embeddings"),
    (dict(torch_fsdp2=True, gradient_accumulation_fusion=False, untie_embeddings=True, pp=2),
     "pipeline parallelism"),
])
def test_megatron_rules_name_each_broken_rule(fields, rule):
    base = dict(world_size=8, num_layers=4, tp=1, pp=1, micro_batch=1, global_batch=16)
    broken = megatron_violations(MegatronArgs(**{**base, **fields}))
    assert any(re.search(rule, v) for v in broken), broken


@pytest.mark.parametrize("name", ["pp1", "pp2-interleaved", "zero3", "tp2-pp2"])
def test_torchtitan_local_batch_is_the_micro_batch(name):
    plan = make_plan(**{**PLANS[name], "micro_batch": 2})
    cfg = plan.config
    doc = tomllib.loads(export_plan(plan, "torchtitan").text)
    train, par = doc["training"], doc["parallelism"]
    assert par["pipeline_parallel_microbatch_size"] == cfg.micro_batch
    if cfg.pp == 1:
        assert train["local_batch_size"] == cfg.micro_batch
    else:  # torchtitan splits the local batch into pipeline micro-batches
        assert train["local_batch_size"] == cfg.micro_batch * cfg.num_microbatches
    dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    # torchtitan's train.py: accumulation = global // (local * dp), with no remainder
    assert train["global_batch_size"] % (train["local_batch_size"] * dp) == 0
    steps = train["global_batch_size"] // (train["local_batch_size"] * dp)
    assert steps * train["local_batch_size"] == cfg.micro_batch * cfg.num_microbatches


@pytest.mark.parametrize("name", ["pp1", "zero3", "tp2-pp2"])
def test_deepspeed_writes_only_keys_its_parser_reads(name):
    plan = make_plan(**PLANS[name])
    doc = json.loads(export_plan(plan, "deepspeed").text)
    assert deepspeed_unknown_keys(doc) == []


def test_deepspeed_interleaved_is_refused():
    with pytest.raises(ValueError, match="interleaved-1f1b"):
        export_plan(make_plan(), "deepspeed")


def test_deepspeed_tp_pp_topology_and_full_recompute():
    plan = make_plan(**PLANS["tp2-pp2"])
    out = export_plan(plan, "deepspeed")
    doc = json.loads(out.text)
    assert doc["pipeline"]["activation_checkpoint_interval"] == 1
    assert "stages" not in doc["pipeline"]
    topo = [n for n in out.notes if "PipelineModule" in n]
    assert topo and "PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)" in topo[0]
    assert "num_stages=" not in topo[0]
    # DeepSpeed's batch identity with dp (not pp x dp ranks or tp x dp ranks)
    assert doc["train_batch_size"] == (doc["train_micro_batch_size_per_gpu"]
                                       * doc["gradient_accumulation_steps"] * plan.config.dp)


def test_an_export_for_another_framework_says_whose_estimate_the_plan_holds():
    import dataclasses

    plan = make_plan(schedule="1f1b", virtual_stages=1)
    assert plan.framework == "autopar"
    other = [n for n in export_plan(plan, "torchtitan").notes if "estimate is autopar's" in n]
    assert len(other) == 1 and "--framework torchtitan" in other[0]
    assert not any("estimate is" in n for n in export_plan(plan, "slurm").notes)  # autopar runs it
    titan = dataclasses.replace(plan, framework="torchtitan")
    assert not any("estimate is" in n for n in export_plan(titan, "torchtitan").notes)
    assert any("estimate is torchtitan's" in n and "--framework megatron-lm" in n
               for n in export_plan(titan, "megatron").notes)
