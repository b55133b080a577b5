"""Acceptance checks of the Plan (issues 4 and 6): the README documents every field of the plan
JSON, and a search cut short by its time budget returns the best plan so far with its gap."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from rich.console import Console

import autopar
from autopar.cost_model.hardware import Cluster
from autopar.report import render_report
from autopar.search import plan, plan_from_config
from tests.fixtures.profiles import analytic_transformer_profile

ROOT = Path(__file__).parents[2]
PROFILE = analytic_transformer_profile(4, 64, 4, 256, 128)


def _schema_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## The plan JSON schema")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _documented(section: str) -> set[str]:
    return set(re.findall(r"`([a-z_0-9]+)`", section))


def test_readme_documents_every_plan_field():
    cluster = Cluster.preset("a100-80g", nodes=1, gpus_per_node=4)
    cfg = autopar.ParallelConfig(tp=2, pp=2, global_batch=8, schedule="interleaved-1f1b",
                                 virtual_stages=2, sequence_parallel=True, zero=1)
    doc = json.loads(plan_from_config(PROFILE, cluster, cfg, model="x").to_json())
    documented = _documented(_schema_section())
    est = doc["estimate"]
    sections = {
        "plan": doc, "config": doc["config"], "stages[0]": doc["stages"][0], "estimate": est,
        "time_breakdown": est["time_breakdown"], "memory_breakdown": est["memory_breakdown"],
        "estimate.stages[0]": est["stages"][0], "search": doc["search"],
    }
    for where, fields in sections.items():
        missing = set(fields) - documented
        assert not missing, f"README's plan schema lacks {where} fields {sorted(missing)}"
    # The cluster section is "as in a cluster YAML": documented with the cost model.
    cost_doc = _documented((ROOT / "docs" / "cost_model.md").read_text())
    missing = set(doc["cluster"]) - documented - cost_doc
    assert not missing, f"cluster fields documented nowhere: {sorted(missing)}"


def test_time_budget_returns_the_best_plan_so_far_with_its_gap():
    # Memory-bound (8 GB devices): several candidates need their ILP solved.
    profile = analytic_transformer_profile(12, 1024, 16, 32000, 1024)
    cluster = Cluster.preset("a100-80g", nodes=1, gpus_per_node=4, gpu_memory_gb=8)
    full = plan(profile, cluster, global_batch=64)
    assert not full.search.time_limit_hit and full.search.mip_gap == 0.0
    assert full.search.ilps_solved >= 2
    stalled: list[int] = []

    def progress(done: int, total: int, message: str) -> None:
        if done >= 1 and not stalled:  # after the first solved candidate, outlast the budget
            stalled.append(done)
            time.sleep(1.2)

    cut = plan(profile, cluster, global_batch=64, time_budget_s=1.0, progress=progress)
    if not stalled:
        pytest.skip("the costing phase used up the whole budget on this machine")
    assert cut.search.time_limit_hit
    assert cut.search.candidates_considered < full.search.candidates_considered
    assert 0.0 < cut.search.mip_gap <= 1.0
    assert cut.estimate.step_time_s >= full.estimate.step_time_s
    # The bound holds: the true optimum is within the reported gap of the returned plan.
    assert full.estimate.step_time_s >= cut.estimate.step_time_s * (1 - cut.search.mip_gap)
    assert autopar.estimate(profile, cluster, cut).to_dict() == cut.estimate.to_dict()
    console = Console(record=True, width=120)
    render_report(console, cut.config, cut.estimate, plan=cut)
    text = console.export_text()
    assert "time limit hit" in text and f"gap {cut.search.mip_gap * 100:.1f}%" in text
