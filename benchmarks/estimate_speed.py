"""Time ``estimate()`` and ``build_cost_table()`` per configuration on this machine.

Usage: python benchmarks/estimate_speed.py [--traced]
Profiles: closed-form (tests/fixtures/profiles.py) unless --traced uses autopar.profile.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autopar.config import ParallelConfig
from autopar.cost_model import build_cost_table, estimate
from autopar.cost_model.hardware import Cluster
from tests.fixtures.profiles import analytic_transformer_profile

CASES = [
    ("llama3-8b-like (32 blocks)", dict(layers=32, hidden=4096, heads=32, vocab=128256,
                                        seq_len=8192, kv_heads=8, ffn_hidden=14336,
                                        gated_mlp=True), 8,
     ParallelConfig(dp=8, tp=8, global_batch=64, zero=3)),
    ("gpt3-175b (96 blocks)", dict(layers=96, hidden=12288, heads=96, vocab=51200,
                                   seq_len=2048), 64,
     ParallelConfig(tp=8, pp=8, global_batch=64, schedule="interleaved-1f1b", virtual_stages=3,
                    recompute="selective", sequence_parallel=True)),
    ("gpt3-175b dp only (96 blocks)", dict(layers=96, hidden=12288, heads=96, vocab=51200,
                                           seq_len=2048), 64,
     ParallelConfig(dp=8, tp=8, global_batch=64, zero=1)),
]


def _time(fn, repeat: int = 200) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> int:
    """Print milliseconds per call."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args()
    print(f"{'case':32s} {'estimate ms':>12s} {'cost table ms':>14s}")
    for name, shape, _nodes, cfg in CASES:
        prof = analytic_transformer_profile(**shape)
        cluster = Cluster.preset("a100-80g", nodes=cfg.world_size // 8)
        est_s = _time(lambda: estimate(prof, cluster, cfg))
        table_s = _time(lambda: build_cost_table(prof, cluster, cfg))
        print(f"{name:32s} {est_s * 1e3:12.3f} {table_s * 1e3:14.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
