"""A framework's pipeline stage splits: DeepSpeed's partition methods as DeepSpeed computes
them, the search and ``estimate`` cutting only those, the export naming the method, and splits
DeepSpeed cannot cut refused (``cost_model/stage_splits.py``)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

import autopar
from autopar.cost_model.partition import uniform_partition
from autopar.cost_model.stage_splits import linear_partition, method_splits, split_method
from autopar.export_base import plan_split_method
from autopar.exporters import export_plan
from autopar.report import render_report
from autopar.search import plan_from_config
from tests.fixtures.profiles import analytic_transformer_profile

ROOT = Path(__file__).resolve().parents[2]
PROFILE = analytic_transformer_profile(14, 1024, 16, 32000, 2048)  # embedding, 14 blocks, head
CLUSTER = autopar.Cluster.preset("a100-80g", nodes=1, gpus_per_node=8)
TIGHT = autopar.Cluster.preset("a100-80g", nodes=1, gpus_per_node=8, gpu_memory_gb=1.5)


def test_uniform_is_blooms_split_with_the_embeddings_as_layers() -> None:
    """BLOOM (70 blocks, pp 12, ``type:transformer|embedding``: each tied embedding one layer):
    "pp rank 0: [embed | 5 transformer blocks] ... pp rank 11: [5 transformer blocks | embed]"
    (bigscience train/tr11-176B-ml/README.md)."""
    blocks = (False,) + (True,) * 70 + (False,)
    split = method_splits(blocks, 12)["uniform"]
    assert split[0] == (0, 5) and split[-1] == (66, 71)
    assert all(b - a == 5 for a, b in split)
    assert uniform_partition(10, 4) == [0, 3, 6, 8, 10]  # the first 10 % 4 stages one longer
    # every layer weighing one (Megatron-DeepSpeed's 'type:transformer|embedding' with tied
    # embeddings at both ends) balances as 'uniform' cuts
    for n, stages in ((72, 12), (107, 35), (10, 4), (16, 3)):
        assert linear_partition([1.0] * n, stages) == uniform_partition(n, stages)


def test_balanced_blocks_leave_the_weightless_layers_at_the_ends() -> None:
    blocks = (False,) + (True,) * 14 + (False,)
    split = method_splits(blocks, 4)["type:<block>"]
    counts = [sum(blocks[a:b + 1]) for a, b in split]
    assert sorted(counts) == [3, 3, 4, 4] and split[0][0] == 0 and split[-1][1] == 15
    assert linear_partition([1, 1, 1, 1], 2) == [0, 2, 4]
    assert linear_partition([5, 1], 3) == [0, 1, 2, 2]  # fewer items than parts: uniform


_DEEPSPEED_PARTS = """
import json, sys, types
import torch.nn as nn
from deepspeed.runtime.pipe.module import PipelineModule

class Embedding(nn.Module): pass
class Block(nn.Module): pass
class Head(nn.Module): pass

out = []
for blocks, stages, method in json.load(sys.stdin):
    layers = [Block() if b else (Embedding() if i == 0 else Head())
              for i, b in enumerate(blocks)]
    topo = types.SimpleNamespace(get_coord=lambda rank: types.SimpleNamespace(pipe=0))
    fake = types.SimpleNamespace(num_stages=stages, global_rank=1, _layer_specs=layers,
                                 _topo=topo, _set_bounds=lambda start, stop: None)
    fake._find_layer_type = types.MethodType(PipelineModule._find_layer_type, fake)
    PipelineModule._partition_layers(fake, method)
    out.append([int(p) for p in fake.parts])
print(json.dumps(out))
"""


def test_the_splits_are_deepspeeds_own_partition() -> None:
    """DeepSpeed's ``PipelineModule._partition_layers`` over one layer per profile layer gives
    the bounds of each method's split (``partition_uniform``, ``partition_balanced``)."""
    if not os.environ.get("CI"):  # there it must be installed
        pytest.importorskip("deepspeed", reason="install requirements-dev.txt")
    cases = []
    for n_blocks in (7, 14, 23, 40, 70):
        blocks = [False] + [True] * n_blocks + [False]
        for stages in (2, 3, 4, 6, 12):
            if stages <= n_blocks:
                cases += [(blocks, stages, "uniform"), (blocks, stages, "type:Block")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _DEEPSPEED_PARTS], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=180, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    parts = json.loads(done.stdout.strip().splitlines()[-1])
    for (blocks, stages, method), bounds in zip(cases, parts, strict=True):
        ours = method_splits(blocks, stages)["uniform" if method == "uniform" else "type:<block>"]
        assert ours == tuple((a, b - 1) for a, b in itertools.pairwise(bounds)), (method, stages)


def test_deepspeed_plans_cut_only_its_partition_methods_and_the_export_names_it() -> None:
    config = autopar.ParallelConfig(dp=2, pp=4, global_batch=16, micro_batch=1)
    plan = plan_from_config(PROFILE, CLUSTER, config, framework="deepspeed")
    split = tuple(s.layers for s in plan.stages)
    blocks = [n.startswith("layers.") for s in plan.stages for n in s.layer_names]
    assert split in method_splits(blocks, 4).values()
    method = plan_split_method(plan, "deepspeed")
    assert method in ("uniform", "type:<block>")
    notes = " ".join(export_plan(plan, "deepspeed").notes)
    want = "uniform" if method == "uniform" else "type:<your block's class name>"
    assert f"partition_method='{want}'" in notes
    megatron_ds = "type:transformer|embedding" if method == "uniform" else "type:transformer"
    assert f"Megatron-DeepSpeed: --pp-partition-method '{megatron_ds}'" in notes
    # the same blocks per stage with Megatron-DeepSpeed's weightless layers at the ends
    ends = [0.0, 0.0] + [1.0] * 14 + [0.0, 0.0, 0.0]
    bounds = linear_partition(ends, 4)
    counts = [sum(ends[a:b]) for a, b in itertools.pairwise(bounds)]
    split = method_splits(blocks, 4)["type:<block>"]
    assert counts == [sum(blocks[a:b + 1]) for a, b in split]
    # 1.5 GB devices: some of the best eight pipeline
    searched = autopar.plan(PROFILE, TIGHT, global_batch=16, framework="deepspeed", top_k=8)
    piped = [p for p in searched if p.config.pp > 1]
    assert piped, "no pipelined DeepSpeed plan among the best eight"
    for p in piped:
        assert plan_split_method(p, "deepspeed") in ("uniform", "type:<block>")
    console = Console(record=True, width=200)
    render_report(console, searched[0].config, searched[0].estimate, plan=searched[0])
    text = console.export_text()
    assert "on the splits its partition methods cut" in text
    if searched[0].config.pp > 1:
        method = plan_split_method(searched[0], "deepspeed")
        assert f"stages cut by PipelineModule partition_method='{method}'" in text
    console = Console(record=True, width=200)
    render_report(console, plan.config, plan.estimate, plan=plan)
    assert f"partition_method='{plan_split_method(plan, 'deepspeed')}'" in console.export_text()


def test_a_split_deepspeed_cannot_cut_is_refused_by_estimate_and_export() -> None:
    config = autopar.ParallelConfig(dp=2, pp=4, global_batch=16, micro_batch=1)
    plan = plan_from_config(PROFILE, CLUSTER, config, framework="autopar")
    first = plan.stages[0]
    odd = ((0, 1), (2, 8), (9, 12), (13, 15))  # no method cuts 2, 7, 4, 3 layers
    assert split_method("partition-methods", odd, [False] + [True] * 14 + [False]) is None
    stages = tuple(dataclasses.replace(s, layers=span, layer_names=tuple(
        "embedding" if i == 0 else "head" if i == 15 else f"layers.{i - 1}"
        for i in range(span[0], span[1] + 1)), recompute=(first.recompute[0],) * (
        span[1] - span[0] + 1)) for s, span in zip(plan.stages, odd, strict=True))
    uneven = dataclasses.replace(plan, stages=stages)
    with pytest.raises(ValueError, match=r"deepspeed splits pipeline stages by partition_method.*"
                                         r"layers per stage 2, 7, 4, 3"):
        autopar.estimate(PROFILE, CLUSTER, uneven, framework="deepspeed")
    with pytest.raises(ValueError, match=r"re-plan for it with .*--framework deepspeed"):
        export_plan(uneven, "deepspeed")
    assert autopar.estimate(PROFILE, CLUSTER, uneven, framework="torchtitan").fits
