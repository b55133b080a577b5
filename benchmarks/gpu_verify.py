"""Whole training steps on one GPU: ``autopar verify`` measurements beside today's predictions.

The plans in ``benchmarks/results/h200/plan_*.json`` were made here with
``autopar plan MODEL --gpus 1 --gpu h200 --global-batch 16 --out ...`` and run on one H200 with
``autopar verify PLAN --steps 5 --warmup 2`` (outputs ``verify2_*.txt`` beside them; the
``verify_*.txt`` files are the first run, before the zoo kept the residual stream 16-bit under
autocast). This script re-predicts each plan with the current cost model and prints the
measured step time and peak memory (``torch.cuda.max_memory_allocated``) beside it.

    .venv/bin/python benchmarks/gpu_verify.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "h200"
_LINE = re.compile(r"^\s*(step time|peak memory)\s+([\d.]+) (ms|MiB)\s*([\d.]+) (ms|MiB)")


def measured(path: Path) -> dict[str, float]:
    """The measured step time (s) and peak memory (bytes) of one ``autopar verify`` output."""
    out: dict[str, float] = {}
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if m:
            scale = 1e-3 if m.group(5) == "ms" else 2.0**20
            out[m.group(1)] = float(m.group(4)) * scale
    if len(out) != 2:
        raise SystemExit(f"{path}: no step time / peak memory lines (did the run fail?)")
    return out


def verify_rows() -> list[dict]:
    """Each stored plan with a measurement: its split, predicted and measured step time (s)
    and peak memory (bytes), the prediction made now."""
    import autopar
    from autopar.cost_model.hardware import Cluster
    from autopar.graph.model_text import build_and_profile
    from autopar.plan import Plan
    from autopar.report import recompute_mix

    rows = []
    for plan_path in sorted(RESULTS.glob("plan_*.json")):
        model = plan_path.stem.removeprefix("plan_")
        run = RESULTS / f"verify2_{model}.txt"
        if not run.exists():
            print(f"{model}: no measurement {run.name}", file=sys.stderr)
            continue
        plan = Plan.from_json(plan_path.read_text())
        profile = build_and_profile(plan.model, seq_len=plan.seq_len or None)[1]
        # Today's preset (the plan carries the preset as it was when planned).
        cluster = Cluster.preset(plan.cluster["name"], nodes=plan.cluster["nodes"],
                                 gpus_per_node=plan.cluster["gpus_per_node"])
        # The same model profiled by today's profiler (its fingerprint may differ from the one
        # the stored plan recorded when it was made): the split is predicted on it on purpose.
        plan = plan.for_profile(profile)
        est = autopar.estimate(profile, cluster, plan.for_cluster(cluster))
        meas = measured(run)
        c = plan.config
        rows.append({
            "model": model,
            "split": f"dp={c.dp} tp={c.tp} pp={c.pp} mb={c.micro_batch} x {c.num_microbatches} "
                     f"recompute {recompute_mix(plan.recompute_per_layer)}",
            "predicted_s": est.step_time_s, "measured_s": meas["step time"],
            "predicted_bytes": est.memory_per_gpu_bytes, "measured_bytes": meas["peak memory"]})
    return rows


def main() -> int:
    print("| model | split | predicted ms | measured ms | error | predicted GiB | measured GiB "
          "| error |\n|---|---|---|---|---|---|---|---|")
    for r in verify_rows():
        t_pred, t_meas = r["predicted_s"], r["measured_s"]
        m_pred, m_meas = r["predicted_bytes"], r["measured_bytes"]
        print(f"| {r['model']} | {r['split']} | {t_pred * 1e3:.0f} | {t_meas * 1e3:.0f} | "
              f"{(t_pred - t_meas) / t_meas * 100:+.1f}% | {m_pred / 2**30:.1f} | "
              f"{m_meas / 2**30:.1f} | {(m_pred - m_meas) / m_meas * 100:+.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
