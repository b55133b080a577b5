"""The accuracy benchmark's figures: Spearman correlation and wrongly ordered pairs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.config import ParallelConfig

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "accuracy.py"
_spec = importlib.util.spec_from_file_location("autopar_accuracy_benchmark", _PATH)
accuracy = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = accuracy  # dataclasses look their module up
_spec.loader.exec_module(accuracy)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0.1, 10.0)), min_size=3, max_size=12))
def test_spearman_matches_scipy(pairs):
    scipy_stats = pytest.importorskip("scipy.stats")
    xs = [float(a) for a, _ in pairs]
    ys = [b for _, b in pairs]
    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return
    expected = scipy_stats.spearmanr(xs, ys).statistic
    assert accuracy.spearman(xs, ys) == pytest.approx(expected, abs=1e-9)


def _row(label: str, predicted: float, measured: float):
    case = accuracy.Case(label=label, model="m", config=ParallelConfig(global_batch=1))
    return accuracy.Row(case=case, predicted_s=predicted, measured_s=measured,
                        predicted_bytes=1.0, measured_bytes=1)


def test_disagreeing_pairs_only_beyond_the_gap():
    rows = [_row("a", 1.0, 3.0), _row("b", 2.0, 2.0), _row("c", 1.2, 1.0)]
    pairs = {(a.case.label, b.case.label) for a, b in accuracy.disagreeing_pairs(rows)}
    # a predicted 2x faster than b but measured slower; a vs c within 30%: not counted.
    assert pairs == {("a", "b")}
    summary = accuracy.summary(rows)
    assert summary["spearman"] == pytest.approx(-0.5)
    assert summary["time_mape"] == pytest.approx((2 / 3 + 0 + 0.2) / 3)
