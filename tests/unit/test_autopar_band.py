"""The ``autopar`` framework record's step-time band is what its measured runs give.

``benchmarks/autopar_band.py`` re-predicts every stored measurement of autopar's runtime (the
CPU accuracy sets and the H200 ``autopar verify`` steps) with the current cost model; the band
the record carries must be the p10-p90 of measured / predicted it prints.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from autopar.cost_model.framework_fit import FIT

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    spec = importlib.util.spec_from_file_location("autopar_band", ROOT / "benchmarks"
                                                  / "autopar_band.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_the_record_band_is_the_measured_band() -> None:
    bench = _benchmark()
    rows = bench.cpu_rows() + bench.gpu_rows()
    assert len(rows) >= 83  # five CPU sessions of 15-16 and the 6 H200 steps
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in rows)
    assert bench.band(rows) == FIT["autopar"]["step_time_band"]
