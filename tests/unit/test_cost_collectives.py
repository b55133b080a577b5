"""expected_collectives counts, per the runtime's torch calls (see collectives.py)."""

from __future__ import annotations

from autopar.config import ParallelConfig
from autopar.cost_model.collectives import expected_collectives
from tests.fixtures.profiles import analytic_transformer_profile

PROFILE = analytic_transformer_profile(4, 64, 4, 256, 32)


def test_tp_counts_without_and_with_sp():
    plain = expected_collectives(PROFILE, ParallelConfig(tp=2, global_batch=2))
    # per micro-batch: 4 blocks x (2 fwd + 2 bwd) + embedding 1 + head 1 all-reduces
    assert plain == {"all_gather_into_tensor@tp": 2, "all_reduce@tp": 36}
    sp = expected_collectives(PROFILE, ParallelConfig(tp=2, global_batch=2,
                                                      sequence_parallel=True))
    assert sp["reduce_scatter_tensor@tp"] == 2 * (4 * 4 + 1)
    assert sp["all_gather_into_tensor@tp"] == 2 * (4 * 4 + 1 + 2)
    full = expected_collectives(PROFILE, ParallelConfig(tp=2, global_batch=2, recompute="full"))
    assert full["all_reduce@tp"] == 36 + 2 * 4 * 2


def test_fsdp_counts_by_zero_stage():
    cfg = dict(dp=2, global_batch=4)  # m = 2 micro-batches, 4 block units + root
    assert expected_collectives(PROFILE, ParallelConfig(zero=3, **cfg)) == {
        "all_gather_into_tensor@dp": 2 * (5 + 4), "reduce_scatter_tensor@dp": 2 * 5}
    assert expected_collectives(PROFILE, ParallelConfig(zero=2, **cfg)) == {
        "all_gather_into_tensor@dp": 5, "reduce_scatter_tensor@dp": 10}
    assert expected_collectives(PROFILE, ParallelConfig(zero=1, **cfg)) == {
        "all_gather_into_tensor@dp": 5, "reduce_scatter_tensor@dp": 5}
    assert expected_collectives(PROFILE, ParallelConfig(zero=0, **cfg)) == {}
