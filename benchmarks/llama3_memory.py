"""Why the two Llama 3 405B runs at 8K tokens are predicted not to fit (README's "Not met" line
and docs/frameworks.md quote these figures).

Run: ``python benchmarks/llama3_memory.py``. For each run, as ``calibration.py`` turns it into
calls (its split: TP 8, PP 16, 8 one-layer chunks a rank, no recompute), under the record's
framework (torchtitan, zero 2) and under Megatron-LM's leanest memory (zero 1: its distributed
optimizer): the binding rank's memory against the usable capacity, its model state and
activations, the block micro-batches it holds (``pipeline.in_flight_microbatches`` times its
chunks), the activations of one, and the largest group N of micro-batches run back to back per
chunk that would fit: an interleaved rank r warms up with (V - 1) N + 2 (pp - 1 - r) chunk
forwards and holds one more (Megatron-LM's get_pp_rank_microbatches with
microbatch_group_size_per_vp_stage = N; Megatron-LM and torch run N >= pp).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import calibration

import autopar
from autopar.cost_model.pipeline import in_flight_microbatches

GIB = 2**30
RUNS = ("llama3_2024_405B_8k_8192gpu", "llama3_2024_405B_8k_16384gpu")


def rows(record_id: str) -> list[dict]:
    """One row per framework: the binding rank's figures (module docstring)."""
    rec = next(r for r in calibration.load_records() if r["id"] == record_id)
    profile, cluster, config, _fw = calibration.record_inputs(rec)
    out = []
    for framework, zero in (("torchtitan", 2), ("megatron-lm", 1)):
        cfg = dataclasses.replace(config, zero=zero)
        est = autopar.estimate(profile, cluster, cfg, framework=framework)
        rank = max(est.stages, key=lambda s: sum(dataclasses.astuple(s.memory)))
        mem = rank.memory
        state = sum(dataclasses.astuple(mem)) - mem.activations_bytes
        blocks = sum(profile.layers[a].kind == "block" for a, _b in rank.layers)
        held = blocks * in_flight_microbatches(cfg.schedule, cfg.pp, cfg.virtual_stages,
                                               cfg.num_microbatches, rank.rank)
        per_block = mem.activations_bytes / held
        room = (est.memory_capacity_bytes - state) / per_block  # block micro-batches that fit
        chunks_warm = 2 * (cfg.pp - 1 - rank.rank) + 1
        group = math.floor((room - chunks_warm) / (cfg.virtual_stages - 1))
        out.append({"framework": framework, "rank": rank.rank,
                    "total_gib": est.memory_per_gpu_bytes / GIB,
                    "capacity_gib": est.memory_capacity_bytes / GIB, "state_gib": state / GIB,
                    "activations_gib": mem.activations_bytes / GIB, "held": held,
                    "per_block_gib": per_block / GIB, "group_fits": group,
                    "microbatches": cfg.num_microbatches, "pp": cfg.pp})
    return out


def main() -> int:
    for record_id in RUNS:
        print(record_id)
        for r in rows(record_id):
            print(f"  {r['framework']:<12} rank {r['rank']}: {r['total_gib']:6.1f} of "
                  f"{r['capacity_gib']:.1f} GiB (state {r['state_gib']:.1f}, activations "
                  f"{r['activations_gib']:.1f}: {r['held']:.0f} block micro-batches of "
                  f"{r['per_block_gib']:.2f} GiB, {r['microbatches']} micro-batches, pp "
                  f"{r['pp']}); fits with a group of N <= {r['group_fits']} micro-batches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
