"""The collectives the cost model's time terms charge equal expected_collectives, call for call.

``expected_collectives`` is checked against the running runtime in
tests/distributed/test_runtime_collectives.py; here ``layer_costs.charged_collectives`` (the
records ``build_cost_table`` times) must give the same counts over a grid of configurations, and
the table's time terms must be exactly those records timed, so time and count cannot drift.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from autopar.config import DTYPE_BYTES, RECOMPUTE, ParallelConfig
from autopar.cost_model import comm
from autopar.cost_model.collectives import expected_collectives, multi_stage_fsdp
from autopar.cost_model.dp_comm import dp_collectives, fsdp_unit_params
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table, charged_collectives
from autopar.cost_model.tied_head import split_tied_head
from autopar.cost_model.tp_comm import tp_collectives
from tests.fixtures.profiles import analytic_transformer_profile

PROFILE = analytic_transformer_profile(4, 64, 4, 256, 32)  # layers: embedding, 4 blocks, head


def _cfg(**kw) -> ParallelConfig:
    return ParallelConfig(**{"global_batch": 2 * kw.get("dp", 1), **kw})


def test_tp_counts_match_the_measured_runtime():
    # docs/runtime.md, measured: no SP n_mb (4L + 2 + F) all-reduces (the vocab-parallel loss's
    # three run inside DTensor's dispatch, unseen); a model file's own loss on all-gathered
    # logits: n_mb logits gathers as well.
    plain = expected_collectives(PROFILE, _cfg(tp=2))
    assert plain == {"all_reduce@tp": 2 * (4 * 4 + 2)}
    gathered = expected_collectives(dataclasses.replace(PROFILE, own_loss=True), _cfg(tp=2))
    assert gathered == {"all_gather_into_tensor@tp": 2, "all_reduce@tp": 2 * (4 * 4 + 2)}
    full = expected_collectives(PROFILE, _cfg(tp=2, recompute="full"))
    assert full["all_reduce@tp"] == 2 * (4 * 4 + 2 + 4)  # w2's all-reduce is not re-run
    assert expected_collectives(PROFILE, _cfg(tp=2, recompute="selective")) == plain
    # SP: n_mb (4L + 2 + 2F) all-gathers, n_mb (4L + 1 + F) reduce-scatters, n_mb all-reduces
    # (the embedding's).
    sp = expected_collectives(PROFILE, _cfg(tp=2, sequence_parallel=True, recompute="full"))
    assert sp == {"all_gather_into_tensor@tp": 2 * (16 + 2 + 8), "all_reduce@tp": 2,
                  "reduce_scatter_tensor@tp": 2 * (16 + 1 + 4)}


def test_fsdp_counts_by_zero_stage_and_pipeline():
    u, m = 5, 2  # 4 block units + the root (embedding and head)
    got = {z: expected_collectives(PROFILE, _cfg(dp=2, zero=z)) for z in (0, 1, 2, 3)}
    assert got[0] == {}  # DDP: its C++ reducer is not a counted collective
    assert got[1] == {"all_gather_into_tensor@dp": u, "reduce_scatter_tensor@dp": u}
    assert got[2] == {"all_gather_into_tensor@dp": u, "reduce_scatter_tensor@dp": u * m}
    assert got[3] == {"all_gather_into_tensor@dp": 2 * u * m, "reduce_scatter_tensor@dp": u * m}
    assert expected_collectives(PROFILE, _cfg(dp=2, tp=2, zero=0))["all_reduce@dp"] == u
    # pp = 2, m = 4 (measured on 4 processes): stage roots are separate units.
    pp = dict(dp=2, pp=2, global_batch=8, schedule="1f1b")
    stage0 = expected_collectives(PROFILE, ParallelConfig(zero=3, **pp), pp_rank=0)
    assert stage0 == {"all_gather_into_tensor@dp": 3 * 5, "reduce_scatter_tensor@dp": 3}
    z2 = expected_collectives(PROFILE, ParallelConfig(zero=2, **pp), pp_rank=1)
    assert z2 == {"all_gather_into_tensor@dp": 3, "reduce_scatter_tensor@dp": 3}
    with pytest.raises(ValueError, match="torch's schedule runtime"):
        expected_collectives(PROFILE, ParallelConfig(
            zero=1, dp=2, pp=2, global_batch=8, schedule="interleaved-1f1b", virtual_stages=2))


GRID = [
    dict(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=sp, recompute=rec,
         global_batch=dp * m, schedule=sched, dtype=dtype)
    for dp, tp, pp, zero, sp, rec, m, sched, dtype in itertools.product(
        (1, 2), (1, 2), (1, 2), (0, 1, 2, 3), (False, True), RECOMPUTE, (1, 2, 4),
        ("gpipe", "1f1b", "interleaved-1f1b"), ("bf16", "fp32"))
    if not (sp and tp == 1) and (pp > 1 or sched == "gpipe") and not (sched == "1f1b" and m < pp)
    and (sched != "interleaved-1f1b" or m % pp == 0)
]


@pytest.mark.parametrize("kw", GRID[::7], ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_charged_collectives_equal_expected(kw):
    virtual = 2 if kw["schedule"] == "interleaved-1f1b" else 1
    cfg = ParallelConfig(virtual_stages=virtual, **kw)
    for rank in range(cfg.pp):
        charged = charged_collectives(PROFILE, cfg, pp_rank=rank)
        if multi_stage_fsdp(cfg):
            with pytest.raises(ValueError):
                expected_collectives(PROFILE, cfg, pp_rank=rank)
            # The tp part is still exact: equal to the same split without data parallelism.
            alone = dataclasses.replace(cfg, dp=1, global_batch=cfg.global_batch // cfg.dp)
            tp_part = {k: v for k, v in charged.items() if k.endswith("@tp")}
            assert tp_part == expected_collectives(PROFILE, alone, pp_rank=rank)
            continue
        assert charged == expected_collectives(PROFILE, cfg, pp_rank=rank)


def _no_overlap_cluster(world: int) -> Cluster:
    data = Cluster.preset("a100-80g", nodes=1, gpus_per_node=world).to_dict()
    data["dp_overlap_efficiency"] = 0.0
    return Cluster.from_dict(data)


@pytest.mark.parametrize(("tp", "dp", "pp", "zero", "sp"), [
    (2, 1, 1, 0, False), (2, 1, 1, 0, True), (2, 2, 1, 3, True), (1, 2, 1, 1, False),
    (1, 2, 1, 2, False), (1, 2, 2, 3, False), (2, 2, 2, 0, False), (1, 2, 1, 0, False)])
def test_time_terms_are_the_charged_records(tp, dp, pp, zero, sp):
    cfg = ParallelConfig(tp=tp, dp=dp, pp=pp, zero=zero, sequence_parallel=sp, global_batch=4 * dp,
                         schedule="1f1b" if pp > 1 else "gpipe")
    cluster = _no_overlap_cluster(cfg.world_size)
    table = build_cost_table(PROFILE, cluster, cfg)
    groups = comm.parallel_groups(cluster, cfg)
    ratio = DTYPE_BYTES[cfg.dtype] / DTYPE_BYTES[PROFILE.dtype]
    for i, (layer, cost) in enumerate(zip(PROFILE.layers, table.layers)):
        tp_calls = tp_collectives(PROFILE, layer, cfg, ratio, first_block=i == 1,
                                  loss_parallel=True)  # autopar's runtime (its default loss)
        for k in range(3):
            assert cost.tp_comm_s[k] == pytest.approx(
                sum(c.time_s(groups["tp"]) for c in tp_calls[k]), rel=1e-12, abs=0.0)
        # The pipeline gives a head tied to the embedding its own copy (tied_head.py).
        dp_calls = dp_collectives(cfg, fsdp_unit_params(split_tied_head(PROFILE, cfg.pp), cfg, i))
        step = sum(c.time_s(groups["dp"]) for c in dp_calls if c.per == "step")
        per_mb = sum(c.time_s(groups["dp"]) for c in dp_calls if c.per == "microbatch")
        assert cost.dp_step_s == pytest.approx(step, rel=1e-12, abs=0.0)
        assert cost.dp_microbatch_s == pytest.approx(per_mb, rel=1e-12, abs=0.0)


def test_message_sizes_are_the_runtime_tensors():
    cfg = ParallelConfig(tp=2, dp=2, zero=3, micro_batch=2, global_batch=8, dtype="bf16")
    b, s, h, v, w = 2, PROFILE.seq_len, PROFILE.hidden, PROFILE.vocab, 2
    ratio = DTYPE_BYTES["bf16"] / DTYPE_BYTES[PROFILE.dtype]
    block = tp_collectives(PROFILE, PROFILE.layers[2], cfg, ratio, first_block=False)[0]
    assert {c.size_bytes for c in block} == {b * s * h * w}  # [b, s, h] activations
    head = tp_collectives(PROFILE, PROFILE.layers[-1], cfg, ratio, first_block=False)[0]
    assert {(c.kind, c.size_bytes) for c in head} == {
        ("all_gather_into_tensor", b * s * v * w), ("all_reduce", b * s * h * w)}
    # FSDP: parameters gathered at the training dtype, gradients reduced in fp32; the root
    # (embedding + head) is one unit charged on the embedding.
    root = PROFILE.layers[0].num_params / 2 + PROFILE.layers[-1].num_params / 2
    assert fsdp_unit_params(PROFILE, cfg, 0) == pytest.approx(root)
    assert fsdp_unit_params(PROFILE, cfg, len(PROFILE.layers) - 1) == 0.0
    calls = dp_collectives(cfg, 1000.0)
    assert sorted((c.kind, c.size_bytes) for c in calls) == [
        ("all_gather_into_tensor", 2000.0), ("all_gather_into_tensor", 2000.0),
        ("reduce_scatter_tensor", 4000.0)]


def test_first_block_sp_cut_is_charged_once():
    cfg = ParallelConfig(tp=2, sequence_parallel=True, global_batch=1)
    table = build_cost_table(PROFILE, Cluster.preset("a100-80g", nodes=1), cfg)
    first, second = table.layers[1].tp_comm_s[0], table.layers[2].tp_comm_s[0]
    assert first > second  # one more all-gather in the first block's backward
    assert dataclasses.replace(table.layers[3], name="x") == dataclasses.replace(
        table.layers[2], name="x")


def test_sp_norm_gradients_are_charged_only_with_dp() -> None:
    # Sequence parallelism leaves the norm parameters' gradients partial over tp; with dp > 1
    # FSDP2 / replicate() all-reduce them at each gradient reduction (measured in
    # tests/distributed/test_runtime_collectives.py): 2 blocks x 2 LayerNorms x 2 tensors + the
    # final LayerNorm's 2 = 10 per reduction for the zoo GPT.
    import autopar
    from autopar.cost_model.collectives import expected_collectives

    profile = autopar.profile(autopar.models.build("gpt", layers=2, hidden=32, heads=4, vocab=64,
                                                   seq_len=8))
    assert sum(x.tp.sequence_param_tensors for x in profile.layers) == 10
    base = dict(tp=2, sequence_parallel=True, micro_batch=1)
    tp_only = expected_collectives(profile, ParallelConfig(**base, global_batch=2))
    z3 = expected_collectives(profile, ParallelConfig(**base, dp=2, zero=3, global_batch=4))
    z1 = expected_collectives(profile, ParallelConfig(**base, dp=2, zero=1, global_batch=4))
    # m = 2 micro-batches: the embedding's all-reduce twice, plus 10 per reduction.
    assert tp_only["all_reduce@tp"] == 2
    assert z3["all_reduce@tp"] == 2 + 10 * 2
    assert z1["all_reduce@tp"] == 2 + 10


@pytest.mark.parametrize("kw", [
    dict(cp=2, dp=2, zero=3), dict(cp=2, dp=2, zero=1, recompute="full"),
    dict(cp=2, tp=2, sequence_parallel=True, recompute="selective"),
    dict(dp=4, dp_replicate=2, zero=1), dict(dp=4, dp_replicate=2, zero=3),
    dict(dp=2, dp_replicate=2, cp=2, zero=2, pp=2, schedule="1f1b")])
def test_cp_and_hsdp_charged_equal_expected(kw):
    """Context parallelism's K/V all-gathers and HSDP's replica all-reduces are charged as
    expected_collectives lists them (held equal to the runtime by test_runtime_dims.py)."""
    cfg = ParallelConfig(global_batch=4 * kw.get("dp", 1), **kw)
    for rank in range(cfg.pp):
        charged = charged_collectives(PROFILE, cfg, pp_rank=rank)
        assert charged == expected_collectives(PROFILE, cfg, pp_rank=rank)
        if cfg.cp > 1:
            assert charged["all_gather_into_tensor@cp"] >= charged["reduce_scatter_tensor@cp"] > 0
        if cfg.dp_replicate > 1:
            assert charged["all_reduce@dp_replicate"] == charged["reduce_scatter_tensor@dp"]


def test_a_collective_with_an_unknown_repetition_or_phase_is_refused() -> None:
    """Two readers test ``per`` against different values (layer_costs.py): a misspelt one would
    be charged once per step by one and every micro-batch by the other."""
    base = dict(kind="all_reduce", axis="dp", size_bytes=1.0, calls=1.0, per="step",
                phase="backward")
    comm.Collective(**base)
    for field, value in (("per", "micro-batch"), ("phase", "bwd")):
        with pytest.raises(ValueError, match=f"Collective.{field}"):
            comm.Collective(**{**base, field: value})


def test_every_export_format_names_the_framework_that_runs_it() -> None:
    from autopar.cost_model.frameworks import FRAMEWORKS, get_framework
    from autopar.exporters import EXPORT_FRAMEWORK, EXPORTERS

    assert set(EXPORT_FRAMEWORK) == set(EXPORTERS)
    assert EXPORT_FRAMEWORK == {"slurm": "autopar", "torchtitan": "torchtitan",
                                "megatron": "megatron-lm", "deepspeed": "deepspeed"}
    assert sorted(f for n in FRAMEWORKS for f in get_framework(n).exports) == sorted(EXPORTERS)
