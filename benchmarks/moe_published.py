"""Published mixture-of-experts runs against autopar's predictions, one row per framework
setting left out, so each mechanism's share shows (the runs are in ``calibration.py``'s set too,
unless outside autopar's space, which is printed; no MoE term is fitted; docs/frameworks.md).

Run: ``python benchmarks/moe_published.py``. For each expert-parallel record of
``benchmarks/data/published_runs.json`` (each number with its source), the calls a user makes
(``models.from_hf_config``, ``profile``, ``Cluster.preset``, ``estimate(..., framework=...)``
with the framework settings the source states), printed once with the record's settings and once
with each left out, so each mechanism's share shows: measured and predicted tokens/s per GPU,
the error, the exposed all-to-all and the memory.
"""

from __future__ import annotations

import json
from pathlib import Path

from calibration import out_of_space

import autopar

RUNS = Path(__file__).parent / "data" / "published_runs.json"


def _config(rec: dict) -> autopar.ParallelConfig:
    p = rec["plan"]
    dtype = p["precision"] if p["precision"] in ("fp16", "fp8") else "bf16"
    return autopar.ParallelConfig(
        dp=p["dp"], tp=p["tp"], pp=p["pp"], cp=p["cp"], ep=p["ep"],
        micro_batch=p["microbatch"], global_batch=p["global_batch"],
        recompute=p["recompute"], zero=p["zero_stage"], dtype=dtype,
        sequence_parallel=p["tp"] > 1)


def rows(rec: dict) -> list[dict]:
    """One row per settings variant: the record's, then each setting left out, then none."""
    m, c = rec["model"], rec["cluster"]
    profile = autopar.profile(autopar.models.from_hf_config(m["hf_config"]), seq_len=m["seq_len"])
    cluster = autopar.Cluster.preset(c["gpu"], nodes=c["n_gpus"] // c["gpus_per_node"],
                                     gpus_per_node=c["gpus_per_node"])
    config = _config(rec)
    stated = tuple(rec.get("framework_settings") or ())
    variants = [stated] + [tuple(x for x in stated if x != s) for s in stated] + [()]
    out = []
    for settings in dict.fromkeys(variants):
        spec = "+".join((rec["framework"], *settings))
        est = autopar.estimate(profile, cluster, config, framework=spec)
        predicted = est.tokens_per_s / cluster.num_gpus
        measured = rec["measured"]["tokens_per_s_per_gpu"]
        out.append({"framework": spec, "measured": measured, "predicted": predicted,
                    "error": predicted / measured - 1, "ep_comm_s": est.time_breakdown.ep_comm_s,
                    "step_s": est.step_time_s, "memory_gib": est.memory_per_gpu_bytes / 2**30,
                    "fits": est.fits})
    return out


def main() -> int:
    for rec in (r for r in json.loads(RUNS.read_text()) if (r["plan"].get("ep") or 1) > 1):
        print(f"{rec['id']} ({rec['model']['name']}, {rec['cluster']['n_gpus']} "
              f"{rec['cluster']['gpu']}, measured {rec['measured']['tokens_per_s_per_gpu']:.0f} "
              "tokens/s per GPU)")
        if why := out_of_space(rec):
            print(f"  outside autopar's space, skipped by calibration.py: {why}; costed below "
                  "as if it were not")
        print(f"  {'framework and settings':<72} {'predicted':>9} {'error':>7} "
              f"{'all-to-all':>10} {'step':>8} {'memory':>10}")
        for r in rows(rec):
            print(f"  {r['framework']:<72} {r['predicted']:>9.0f} {r['error']:>+7.1%} "
                  f"{r['ep_comm_s']:>9.2f}s {r['step_s']:>7.2f}s {r['memory_gib']:>6.1f} GiB"
                  f"{'' if r['fits'] else ' (does not fit)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
