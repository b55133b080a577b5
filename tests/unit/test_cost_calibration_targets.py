"""The cost model against the published runs: the calibration targets hold (a regression guard).

Same computation as ``benchmarks/calibration.py`` (closed-form profiles, which give the same
summary as traced ones and take a fraction of a second): median absolute error of tokens/s per
GPU <= 10%, p90 <= 25%, and every run that really ran is predicted to fit in memory.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "calibration_benchmark", ROOT / "benchmarks" / "calibration.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_published_runs_are_predicted_within_the_targets() -> None:
    bench = _benchmark()
    records = [
        r for r in json.loads(bench.RUNS.read_text()) if r["record_type"] == "training_throughput"
    ]
    assert len(records) >= 10
    profiles = [bench.record_profile(r, traced=False) for r in records]
    rows = bench.evaluate(records, profiles)
    median, p90 = bench.summary(rows)
    assert median <= 0.10, f"median |error| {median:.1%}"
    assert p90 <= 0.25, f"p90 |error| {p90:.1%}"
    assert all(r["fits"] for r in rows), [r["id"] for r in rows if not r["fits"]]
