"""Published mixture-of-experts runs against autopar's predictions, one row per framework
setting left out, so each mechanism's share shows (the runs are in ``calibration.py``'s set too,
unless outside autopar's space, which is printed; no MoE term is fitted; docs/frameworks.md).

Run: ``python benchmarks/moe_published.py``. For each expert-parallel record of
``benchmarks/data/published_runs.json`` (each number with its source), the calls a user makes
(``calibration.record_inputs``: ``models.from_hf_config``, ``profile``, ``Cluster.preset``,
the record's split; ``estimate(..., framework=...)`` with the framework settings the source
states), printed once with the record's settings and once
with each left out, so each mechanism's share shows: measured and predicted tokens/s per GPU,
the error, the exposed all-to-all and the memory.
"""

from __future__ import annotations

from calibration import load_records, measured_tokens_per_gpu, out_of_space, record_inputs

import autopar


def rows(rec: dict) -> list[dict]:
    """One row per settings variant: the record's, then each setting left out, then none
    (the record's inputs as calibration.py builds them; a variant the framework refuses, one
    setting needing another, is a row saying why)."""
    profile, cluster, config, _fw = record_inputs(rec)
    measured = measured_tokens_per_gpu(rec, profile)
    stated = tuple(rec.get("framework_settings") or ())
    variants = [stated] + [tuple(x for x in stated if x != s) for s in stated] + [()]
    out = []
    for settings in dict.fromkeys(variants):
        spec = "+".join((rec["framework"], *settings))
        try:
            est = autopar.estimate(profile, cluster, config, framework=spec)
        except ValueError as refused:  # a setting another one needs was left out
            out.append({"framework": spec, "refused": str(refused)})
            continue
        predicted = est.tokens_per_s / cluster.num_gpus
        out.append({"framework": spec, "measured": measured, "predicted": predicted,
                    "error": predicted / measured - 1, "ep_comm_s": est.time_breakdown.ep_comm_s,
                    "step_s": est.step_time_s, "memory_gib": est.memory_per_gpu_bytes / 2**30,
                    "fits": est.fits})
    return out


def main() -> int:
    for rec in (r for r in load_records() if (r["plan"].get("ep") or 1) > 1):
        table = rows(rec)
        print(f"{rec['id']} ({rec['model']['name']}, {rec['cluster']['n_gpus']} "
              f"{rec['cluster']['gpu']}, measured {table[0]['measured']:.0f} tokens/s per GPU)")
        if why := out_of_space(rec):
            print(f"  outside autopar's space, skipped by calibration.py: {why}; costed below "
                  "as if it were not")
        width = max(len(r["framework"]) for r in table)
        print(f"  {'framework and settings':<{width}} {'predicted':>9} {'error':>7} "
              f"{'all-to-all':>10} {'step':>8} {'memory':>10}")
        for r in table:
            if "refused" in r:
                print(f"  {r['framework']:<{width}} refused: {r['refused']}")
                continue
            print(f"  {r['framework']:<{width}} {r['predicted']:>9.0f} {r['error']:>+7.1%} "
                  f"{r['ep_comm_s']:>9.2f}s {r['step_s']:>7.2f}s {r['memory_gib']:>6.1f} GiB"
                  f"{'' if r['fits'] else ' (does not fit)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
