"""The ``autopar`` framework record's step-time band, from autopar's own measured runs.

Every other framework's band is the p10-p90 of its leave-one-source-out residuals over published
runs (``calibration.py --loso``). autopar's runtime has no published runs; its band comes from
the runs measured here, each re-predicted with the current cost model:

* the CPU accuracy sets (``benchmarks/results/accuracy_cpu_*.measurements.json``): 16
  configurations on 4 gloo processes each, predicted on the cluster calibrated in the same
  session (the ``.calibration.json`` beside it), exactly as ``accuracy.py`` replays them;
* the whole steps measured on one H200 with ``autopar verify`` (``gpu_verify.py``).

It prints each run's measured / predicted step time and the band (10th and 90th percentile, the
same rule as ``calibration.step_time_band``) beside the value the record carries
(``autopar/cost_model/framework_fit.py``); ``tests/unit/test_autopar_band.py`` keeps the two equal.

    .venv/bin/python benchmarks/autopar_band.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_rows() -> list[dict]:
    """Each stored CPU measurement, predicted now on its own session's calibration."""
    import accuracy

    from autopar.cost_model.calibration import Calibration, calibration_to_cluster

    rows = []
    for store in sorted(RESULTS.glob("accuracy_cpu_*.measurements.json")):
        session = store.name.removesuffix(".measurements.json")
        cal_path = store.with_name(f"{session}.calibration.json")
        cluster = calibration_to_cluster(Calibration.from_dict(json.loads(cal_path.read_text())))
        measured = json.loads(store.read_text())
        for case in accuracy.cases("fp32"):
            if case.label not in measured:
                continue  # never measured in this session: the band takes no new runs
            row = accuracy.run_case(case, cluster, 0, 0, measured)
            if row.error:
                raise SystemExit(f"{session} {case.label}: {row.error}")
            rows.append({"set": session, "run": case.label, "predicted_s": row.predicted_s,
                         "measured_s": row.measured_s})
    return rows


def gpu_rows() -> list[dict]:
    """Each whole step measured on the H200 (``gpu_verify.verify_rows``)."""
    import gpu_verify

    return [{"set": "h200 verify", "run": r["model"], "predicted_s": r["predicted_s"],
             "measured_s": r["measured_s"]} for r in gpu_verify.verify_rows()]


def band(rows: list[dict]) -> tuple[float, float]:
    """10th and 90th percentile of measured / predicted step time, rounded to 0.01."""
    import calibration

    low, high = calibration.step_time_band(
        [{"error": r["measured_s"] / r["predicted_s"] - 1} for r in rows])
    return round(low, 2), round(high, 2)


def main() -> int:
    from autopar.cost_model.framework_fit import FIT

    rows = cpu_rows() + gpu_rows()
    print("| set | run | predicted ms | measured ms | measured / predicted |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['run']} | {r['predicted_s'] * 1e3:.1f} | "
              f"{r['measured_s'] * 1e3:.1f} | {r['measured_s'] / r['predicted_s']:.3f} |")
    low, high = band(rows)
    print(f"\nautopar step-time band over {len(rows)} runs (p10, p90 of measured / predicted): "
          f"({low:.2f}, {high:.2f}); the framework record carries "
          f"{tuple(FIT['autopar']['step_time_band'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
