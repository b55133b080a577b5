"""Out-of-sample check of cp and fp8: the published runs calibration skips, predicted unfitted.

``benchmarks/calibration.py`` leaves the records with fp8 matmuls or context parallelism out of
its fit (``out_of_space``). Their frameworks' fitted records (fitted without them) predict them
here as the record states its split, with cp and fp8 as the record gives them; nothing is refit,
so the error is out of sample.

Run: ``python benchmarks/dims_accuracy.py`` (``--only ID_PREFIX`` for a subset).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import autopar

sys.path.insert(0, str(Path(__file__).parent))
import calibration as cal


def dims_config(rec: dict, profile, cluster, fw) -> autopar.ParallelConfig:
    """The record's split with its cp and precision (the first recompute mode that fits)."""
    p = rec["plan"]
    cp = int(p.get("cp") or 1)
    dtype = "fp8" if p.get("precision") == "fp8" else (
        "fp16" if p.get("precision") == "fp16" else "bf16")
    chosen = None
    for config in cal.record_configs(rec, profile.num_layers):
        zero = config.zero if config.dp * cp > 1 else 0
        if cp > 1 and zero == 0 and rec["framework"] == "torchtitan":
            zero = 3  # torchtitan shards over dp_shard * cp whenever cp > 1
        chosen = dataclasses.replace(config, cp=cp, dtype=dtype, zero=zero)
        if autopar.estimate(profile, cluster, chosen, framework=fw).fits:
            break
    return chosen


def row(rec: dict) -> dict:
    """Measured and predicted tokens/s per GPU of one record."""
    profile, cluster = cal.record_profile(rec), cal.record_cluster(rec)
    fw = cal.record_framework(rec)
    config = dims_config(rec, profile, cluster, fw)
    est = autopar.estimate(profile, cluster, config, framework=fw)
    measured = cal.measured_tokens_per_gpu(rec, profile)
    predicted = est.tokens_per_s / cluster.num_gpus
    return {"id": rec["id"], "config": config.describe(), "measured": measured,
            "predicted": predicted, "error": predicted / measured - 1, "fits": est.fits,
            "cp_s": est.time_breakdown.cp_comm_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="only records whose id starts so")
    args = parser.parse_args()
    records = [r for r in cal.load_records() if r["id"].startswith(args.only)
               and (r["plan"].get("precision") == "fp8" or (r["plan"].get("cp") or 1) > 1)]
    errors = []
    for rec in records:
        try:
            r = row(rec)
        except (ValueError, autopar.AutoparError) as e:
            print(f"{rec['id']:58s} not estimated: {e}", flush=True)
            continue
        errors.append(abs(r["error"]))
        print(f"{r['id']:58s} {r['measured']:9.0f} {r['predicted']:9.0f} {100 * r['error']:+6.1f}%"
              f" {'fits' if r['fits'] else 'OOM '} {r['config']}", flush=True)
    errors.sort()
    if errors:
        print(f"{len(errors)} runs: median |error| {100 * errors[len(errors) // 2]:.1f}%, "
              f"p90 {100 * errors[min(len(errors) - 1, int(0.9 * len(errors)))]:.1f}%")


if __name__ == "__main__":
    main()
