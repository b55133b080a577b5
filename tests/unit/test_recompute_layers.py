"""A framework's per-layer recompute: the patterns it sets, the search proposing only those,
the exports writing them, and plans it cannot run refused (``cost_model/recompute_layers.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import tomllib
from rich.console import Console

import autopar
from autopar.cost_model.recompute_layers import (
    pattern_counts,
    pattern_recompute,
    recompute_pattern,
    recompute_refusal,
)
from autopar.export_base import plan_recompute
from autopar.exporters import export_plan
from autopar.plan import Plan
from autopar.report import render_report
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
