"""A framework's per-layer recompute: the patterns it sets, the search proposing only those,
the exports writing them, and plans it cannot run refused (``cost_model/recompute_layers.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import tomllib
from rich.console import Console

import autopar
from autopar.cost_model.estimator import estimate as estimate_split
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.recompute_layers import (
    pattern_counts,
    pattern_recompute,
    recompute_pattern,
    recompute_refusal,
)
from autopar.export_base import plan_recompute
from autopar.exporters import export_plan
from autopar.plan import Plan
from autopar.report import _ordinal, _search_line, render_report
from autopar.search import plan_from_config
from tests.fixtures.profiles import analytic_transformer_profile

PROFILE = analytic_transformer_profile(16, 1024, 16, 2048, 1024)
TIGHT = autopar.Cluster.preset("a100-80g", nodes=1, gpus_per_node=4, gpu_memory_gb=3)
EMB, B, HEAD = False, True, False


def test_first_n_recomputes_the_leading_blocks_of_every_stage() -> None:
    """Megatron-LM's block method: layers 0 <= i < n of each stage's own blocks."""
    blocks = (EMB, B, B, B, B, B, HEAD)
    split = ((0, 2), (3, 4), (5, 6))
    got = pattern_recompute("first-n", 1, split, blocks, (0, 1, 2))
    assert got == ("none", "full", "none", "full", "none", "full", "none")
    assert recompute_pattern("first-n", got, split, blocks, (0, 1, 2)) == ("first-n", 1)
    assert list(pattern_counts("first-n", split, blocks, (0, 1, 2))) == [1]


def test_every_nth_counts_the_blocks_of_a_rank_over_its_stages() -> None:
    """torchtitan's layer AC: one counter per process over the rank's model chunks in order,
    a block recomputed when the count is a multiple of n."""
    blocks = (EMB, B, B, B, B, B, B, B, B, HEAD)
    split = ((0, 2), (3, 4), (5, 6), (7, 9))  # two ranks, interleaved: stages 0, 2 on rank 0
    ranks = (0, 1, 0, 1)
    got = pattern_recompute("every-nth", 2, split, blocks, ranks)
    # rank 0 builds blocks 1, 2, 5, 6 (counts 1-4); rank 1 builds 3, 4, 7, 8
    assert [i for i, r in enumerate(got) if r == "full"] == [2, 4, 6, 8]
    assert recompute_pattern("every-nth", got, split, blocks, ranks) == ("every-nth", 2)
    assert recompute_pattern("first-n", got, split, blocks, ranks) is None
    assert "every n-th" in recompute_refusal("torchtitan", "every-nth", ("full",) * 3 + (
        "none",) * 7, split, blocks, ranks)


def test_one_mode_on_every_block_is_every_frameworks_whatever_the_other_layers() -> None:
    blocks = (EMB, B, B, HEAD)
    for kind in ("any", "first-n", "every-nth", "uniform"):
        assert recompute_pattern(kind, ("none", "full", "full", "full"), ((0, 3),), blocks,
                                 (0,)) == ("uniform", 0)
    mixed = ("none", "selective", "full", "none")
    assert recompute_pattern("uniform", mixed, ((0, 3),), blocks, (0,)) is None
    assert recompute_pattern("any", mixed, ((0, 3),), blocks, (0,)) == ("any", 0)


def _full_blocks(plan: Plan) -> list[int]:
    return [i for s in plan.stages for i, (n, r) in enumerate(
        zip(s.layer_names, s.recompute, strict=True), start=s.layers[0])
        if n.startswith("layers.") and r == "full"]


def test_the_search_recomputes_as_each_framework_sets_it_and_the_exports_write_it() -> None:
    """On 3 GB devices the plans recompute some blocks only: the first n under Megatron-LM
    (--recompute-method block --recompute-num-layers n), every n-th under torchtitan
    (selective_ac_option "n"); the estimate of each plan is its own."""
    megatron = autopar.plan(PROFILE, TIGHT, global_batch=32, framework="megatron-lm")
    kind, n = plan_recompute(megatron, "megatron-lm")
    assert kind == "first-n" and 0 < n < 16
    flags = export_plan(megatron, "megatron").text.split()
    assert flags[flags.index("--recompute-method") + 1] == "block"
    assert flags[flags.index("--recompute-num-layers") + 1] == str(n)
    titan = autopar.plan(PROFILE, TIGHT, global_batch=32, framework="torchtitan")
    kind, n = plan_recompute(titan, "torchtitan")
    assert kind == "every-nth" and n >= 2
    doc = tomllib.loads(export_plan(titan, "torchtitan").text)
    assert doc["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": str(n)}
    for p in (megatron, titan):
        assert autopar.estimate(PROFILE, TIGHT, p).step_time_s == pytest.approx(
            p.estimate.step_time_s)
    # the report says each in the framework's terms, and that the search was not the ILP's
    console = Console(record=True, width=200)
    render_report(console, megatron.config, megatron.estimate, plan=megatron)
    text = console.export_text()
    first = plan_recompute(megatron, "megatron-lm")[1]
    assert f"recompute=full on the first {first} blocks of each stage, none on the rest" in text
    assert "recompute choices on balanced splits" in text


def test_a_mix_the_framework_cannot_set_is_refused_by_estimate_and_export() -> None:
    megatron = autopar.plan(PROFILE, TIGHT, global_batch=32, framework="megatron-lm")
    blocks = [i for s in megatron.stages for i, n in enumerate(s.layer_names, s.layers[0])
              if n.startswith("layers.")]
    full = {blocks[0], blocks[5]}  # not a prefix of every stage, not every n-th
    stages = tuple(dataclasses.replace(s, recompute=tuple(
        "full" if i in full else "none" for i in range(s.layers[0], s.layers[1] + 1)))
        for s in megatron.stages)
    mixed = dataclasses.replace(megatron, stages=stages)
    assert _full_blocks(mixed) == sorted(full)
    for fw in ("megatron-lm", "torchtitan"):
        with pytest.raises(ValueError, match=f"{fw} recomputes .* not this plan's mix"):
            autopar.estimate(PROFILE, TIGHT, mixed, framework=fw)
    for to in ("megatron", "torchtitan", "deepspeed"):
        with pytest.raises(ValueError, match="2 of 16 blocks recomputed"):
            export_plan(mixed, to)
    assert autopar.estimate(PROFILE, TIGHT, mixed, framework="autopar").framework == "autopar"


def test_every_framework_recomputes_blocks_only_and_keeps_the_embedding_and_head() -> None:
    """autopar's runtime (apply_recompute), Megatron-LM, torchtitan and Megatron-DeepSpeed
    checkpoint transformer layers only: a config's full recompute is costed on the blocks, the
    plan records none on the others, a plan saying full on them is estimated as what runs, and
    the cost table costs every mode of a non-block layer as none."""
    config = autopar.ParallelConfig(dp=2, pp=2, micro_batch=1, global_batch=32, recompute="full")
    cluster = autopar.Cluster.preset("a100-80g", nodes=1, gpus_per_node=4)
    assert PROFILE.layers[-1].saved_bytes["full"] < PROFILE.layers[-1].saved_bytes["none"]
    for fw in ("autopar", "megatron-lm", "torchtitan", "deepspeed"):
        plan = plan_from_config(PROFILE, cluster, config, framework=fw)
        per_layer = plan.recompute_per_layer
        assert per_layer[0] == per_layer[-1] == "none" and set(per_layer[1:-1]) == {"full"}
        est = autopar.estimate(PROFILE, cluster, config, framework=fw)
        assert est.step_time_s == pytest.approx(plan.estimate.step_time_s)
        everything = dataclasses.replace(plan, stages=tuple(dataclasses.replace(
            s, recompute=("full",) * len(s.recompute)) for s in plan.stages))
        again = autopar.estimate(PROFILE, cluster, everything, framework=fw)
        assert again.step_time_s == pytest.approx(est.step_time_s)
        assert again.memory_per_gpu_bytes == pytest.approx(est.memory_per_gpu_bytes)
        console = Console(record=True, width=200)
        render_report(console, plan.config, plan.estimate, plan=plan)
        text = console.export_text()
        assert "recompute=full " in text and "recompute=full on" not in text
        table = build_cost_table(PROFILE, cluster, config, fw)
        for cost, block in zip(table.layers, table.block_mask, strict=True):
            assert block or len(set(cost.act_bytes)) == len(set(cost.recompute_s)) == 1


def test_a_malformed_split_is_named_before_what_the_framework_runs() -> None:
    config = autopar.ParallelConfig(dp=2, pp=2, micro_batch=1, global_batch=32)
    cluster = autopar.Cluster.preset("a100-80g", nodes=1, gpus_per_node=4)
    n = PROFILE.num_layers
    for fw in ("autopar", "megatron-lm", "torchtitan", "deepspeed"):
        with pytest.raises(ValueError, match=f"split covers {n + 3} layers"):
            estimate_split(PROFILE, cluster, config, fw, split=((0, 4), (5, n + 2)))
        with pytest.raises(ValueError, match="one recompute choice"):
            estimate_split(PROFILE, cluster, config, fw, split=((0, 4), (5, n - 1)),
                           recompute=("full",) * (n - 1))


def test_the_report_words_every_nth_with_its_ordinal_and_an_ilp_gap_as_a_gap() -> None:
    assert [_ordinal(n) for n in (2, 3, 4, 11, 12, 13, 21, 22, 23, 111)] == [
        "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "111th"]
    plan = autopar.plan(PROFILE, TIGHT, global_batch=32)  # autopar: the per-layer ILP
    unproven = dataclasses.replace(plan, search=dataclasses.replace(
        plan.search, optimal=False, mip_gap=0.0003))
    line = _search_line(unproven)
    assert line is not None and "gap 0.0%" in line and "framework's" not in line
