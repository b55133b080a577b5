"""benchmarks/runtime_overhead.py compares like with like: its hand-composed torch path and
autopar's runtime path give the same losses step for step (a correctness check, not a timing one).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

# Spawned ranks unpickle ``runtime_overhead.bench_split``: they inherit this sys.path.
_BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.append(_BENCHMARKS)
import runtime_overhead  # noqa: E402

MODEL = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq_len=16"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_hand_and_autopar_paths_give_the_same_losses(run_distributed: Any) -> None:
    split = next(s for s in runtime_overhead.SPLITS if s.name == "tp=2 +sp")
    plan = runtime_overhead.make_plan(split, MODEL)
    results = run_distributed(
        runtime_overhead.bench_split, 2, split, plan.to_dict(), MODEL, 2, 2, timeout_s=100
    )
    for row in results:
        losses = row["losses"]
        assert len(losses["autopar"]) == len(losses["hand"]) == 4
        assert row["loss_rel_diff"] <= 1e-5, losses
