"""The text report and the alternatives' deltas in words."""

from __future__ import annotations

import dataclasses

from report_fixtures import GIB, make_estimate, make_plan
from rich.console import Console

from autopar.report import (
    Alternative,
    describe_alternative,
    format_count,
    format_time,
    render_report,
)
from autopar.units import format_bytes


def test_formatters():
    assert format_bytes(1.9 * 1024 * GIB) == "1.9 TiB"
    assert format_bytes(80 * GIB) == "80.0 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**50) == "3.0 PiB" and format_bytes(2048, digits=2) == "2.00 KiB"
    assert format_time(12.345) == "12.35 s" and format_time(0.0456) == "45.6 ms"
    assert format_time(0) == "0"
    assert format_count(175e9) == "175.0B" and format_count(6.7e6) == "6.7M"


def test_alternative_that_does_not_fit_says_how_much_it_needs():
    best = make_estimate(make_plan().config)
    alt = Alternative(label="pure DP", estimate=make_estimate(make_plan().config, mem_gib=1945.6))
    text = describe_alternative(alt, best)
    assert text == "pure DP: needs 1.9 TiB per GPU (capacity 76.0 GiB)"


def test_alternative_names_the_term_that_grew_and_node_crossing():
    plan = make_plan()
    cfg = dataclasses.replace(plan.config, tp=16, dp=1)
    alt = Alternative(label="tp=16", config=cfg, estimate=make_estimate(cfg, step_s=2.6,
                                                                         tp_comm_s=0.6))
    text = describe_alternative(alt, plan.estimate, gpus_per_node=8)
    assert text == "tp=16: crosses nodes; step +30%: TP communication 100.0 ms -> 600.0 ms"
    assert "crosses" not in describe_alternative(alt, plan.estimate, gpus_per_node=16)


def test_alternative_without_estimate_gives_the_reason():
    alt = Alternative(label="tp=32", reason="heads 4 not divisible by tp 32")
    text = describe_alternative(alt, make_plan().estimate)
    assert text == "tp=32: heads 4 not divisible by tp 32"


def test_report_shows_split_breakdown_stages_binding_and_alternatives():
    plan = make_plan()
    console = Console(record=True, width=140)
    alts = [Alternative(label="pure DP", estimate=make_estimate(plan.config, mem_gib=2000))]
    render_report(console, plan.config, plan.estimate, title="T", plan=plan, alternatives=alts)
    text = console.export_text()
    for needle in ("Split  dp=2 tp=2 pp=2", "MFU 48.0%", "Binding memory of pipeline rank 0",
                   "pipeline bubble", "7.5%", "TP communication (exposed)", "optimizer step",
                   "0-1,3-4 (4)", "2,5 (2)", "40.0 GiB (53%)", "pure DP: needs", "tokens/s 256"):
        assert needle in text, needle
    assert text.isascii()


def test_the_per_rank_columns_are_every_kind_of_memory():
    """The per-rank table's columns and the memory plot's bars hold every term of a rank's
    memory once, so they add to its total (the pipeline's receive buffers had been left out:
    8 GiB of a 72.5 GiB Llama 3 405B rank shown in no column)."""
    from autopar.cost_model.estimate import MemoryBreakdown
    from autopar.plotting import MEMORY_COLORS
    from autopar.report import MEMORY_KINDS, TABLE_MEMORY_COLUMNS

    fields = [f.name for f in dataclasses.fields(MemoryBreakdown)]
    assert [field for field, _ in MEMORY_KINDS] == fields
    assert len(MEMORY_COLORS) == len(MEMORY_KINDS)
    assert [f for _, group in TABLE_MEMORY_COLUMNS for f in group] == fields


def test_fp8_mfu_names_the_peak_it_is_a_fraction_of():
    """MFU of an fp8 plan is of the 16-bit peak (Estimate.mfu), so it can pass 100%: the
    report says which peak."""
    import dataclasses

    plan = make_plan()
    fp8 = dataclasses.replace(plan.config, dtype="fp8")
    texts = []
    for config in (plan.config, fp8):
        console = Console(record=True, width=140)
        render_report(console, config, plan.estimate, title="T", plan=plan)
        texts.append(console.export_text())
    assert "MFU 48.0%\n" in texts[0] and "MFU 48.0% (of the bf16 peak)" in texts[1]
