"""Memory terms that follow what the runtime holds at its peak (measured on CPU runs)."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.config import DTYPE_BYTES, ParallelConfig
from autopar.cost_model.frameworks import get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.memory import GRAD_BYTES, fsdp_accumulates_grads, layer_state
from tests.fixtures.profiles import analytic_transformer_profile

PROFILE = analytic_transformer_profile(4, 256, 8, 1024, 128)
CLUSTER = Cluster.preset("a100-80g", nodes=1, gpus_per_node=4)
W = DTYPE_BYTES["bf16"]  # the profile's and the configs' dtype
# The exact live bytes: autopar's runtime without the allocator's fragmentation share.
EXACT = dataclasses.replace(get_framework("autopar"), fragmentation_fraction=0.0)


def _cfg(**kw) -> ParallelConfig:
    return ParallelConfig(**{"global_batch": 16, "dtype": "bf16", **kw})


def _table(**kw):
    return build_cost_table(PROFILE, CLUSTER, _cfg(**kw), EXACT)


def _block(table):
    return next(x for x, p in zip(table.layers, PROFILE.layers) if p.kind == "block")


def test_replicate_keeps_accumulated_grads_with_several_microbatches() -> None:
    one = _cfg(dp=2, tp=2, micro_batch=4)  # m = 16 / dp / micro_batch = 2
    assert one.num_microbatches == 2 and fsdp_accumulates_grads(one)
    single = _cfg(dp=2, tp=2, micro_batch=8)
    assert single.num_microbatches == 1 and not fsdp_accumulates_grads(single)
    assert layer_state(100.0, one).grad_bytes == 2 * GRAD_BYTES * 100.0
    assert layer_state(100.0, single).grad_bytes == GRAD_BYTES * 100.0
    ddp = _cfg(dp=4, micro_batch=2)  # DDP: buckets, no FSDP2 accumulator
    assert not fsdp_accumulates_grads(ddp)


def test_sequence_parallel_keeps_gathered_linear_inputs_whole() -> None:
    tp, b = 2, 2
    sp = _block(_table(tp=tp, micro_batch=b, sequence_parallel=True)).act_bytes
    plain = _block(_table(tp=tp, micro_batch=b)).act_bytes
    layer = PROFILE.layers[1]
    rep = layer.saved_bytes_replicated["none"] * b
    hidden = PROFILE.seq_len * PROFILE.hidden * W * b  # one [b, s, h] input
    # SP shards the replicated part except the two gathered inputs (attention, MLP).
    expected = plain[0] - rep + rep / tp + 2 * hidden * (1 - 1 / tp)
    assert sp[0] == pytest.approx(expected)
    assert sp[0] < plain[0]
    # Full recompute saves only the (sharded) block input; the gathered inputs are re-created.
    assert sp[2] == pytest.approx(layer.saved_bytes["full"] * b / tp)


def test_gpipe_charges_activations_net_of_backward_state() -> None:
    gpipe = _block(_table(pp=2, micro_batch=2, schedule="gpipe"))
    one_f_one_b = _block(_table(pp=2, micro_batch=2, schedule="1f1b"))
    m = _cfg(pp=2, micro_batch=2).num_microbatches
    grads = GRAD_BYTES * PROFILE.layers[1].num_params
    a = one_f_one_b.act_bytes[0]
    assert gpipe.act_bytes[0] == pytest.approx(a - min(a, grads) / m)
    # The layer's total over the step: (m - 1) a + max(a, grads).
    assert m * gpipe.act_bytes[0] + grads == pytest.approx((m - 1) * a + max(a, grads))


def test_zero3_root_unit_stays_gathered() -> None:
    z3 = _table(dp=4, micro_batch=4, zero=3)
    z3_pp = _table(dp=2, pp=2, micro_batch=4, zero=3)
    z0 = _table(dp=4, micro_batch=4)
    roots = [p.num_params for p in PROFILE.layers if p.kind != "block" and p.num_params]
    # gathered params; the head's gradient in the parameters' dtype until the root's reduce
    expected = W * sum(roots) + W * sum(roots[1:])
    assert z3.buffers_bytes - z0.buffers_bytes == pytest.approx(expected)
    assert z3_pp.buffers_bytes == _table(dp=2, pp=2, micro_batch=4).buffers_bytes
    # The root's own gather and the head's gradient are those buffers, not the head's working
    # set: beside its loss it holds the prefetched last block. The embedding's backward ends
    # with the root's reduce-scatter, which casts every root gradient to fp32.
    logits = PROFILE.seq_len * PROFILE.vocab * 4
    output = PROFILE.layers[-1].output_bytes * 4
    block, emb, head = (PROFILE.layers[i].num_params for i in (1, 0, -1))
    assert z3.layers[-1].transient_bytes[0] == pytest.approx(
        (W + 2 * 4) * logits + 2 * output + W * block)
    assert z3.layers[0].transient_bytes[0] == pytest.approx(
        2 * PROFILE.layers[0].output_bytes * 4 + W * block + (W + 4) * emb + 4 * head)
    # torchtitan wraps the embedding and [norm, output] as their own units, and DeepSpeed's
    # stage 3 gathers them like any module, in its buckets: no root is held.
    for framework in ("torchtitan", "deepspeed"):
        z3 = build_cost_table(PROFILE, CLUSTER, _cfg(dp=4, micro_batch=4, zero=3), framework)
        z1 = build_cost_table(PROFILE, CLUSTER, _cfg(dp=4, micro_batch=4, zero=1), framework)
        assert z3.buffers_bytes == z1.buffers_bytes, framework


def test_loss_backward_holds_logits_and_two_fp32_gradients() -> None:
    table = _table(micro_batch=2)
    head = table.layers[-1]
    logits = PROFILE.seq_len * PROFILE.vocab * 2
    output = PROFILE.layers[-1].output_bytes * 2
    assert head.transient_bytes[0] == pytest.approx((W + 2 * 4) * logits + 2 * output)


def test_fsdp_accumulator_and_sharded_gradient_never_coexist() -> None:
    # zero 1 with gradient accumulation: the unsharded fp32 accumulator (4 B) is replaced by the
    # sharded gradient (4/n B) at its reduce-scatter: 4 B per parameter, not 4 + 4/n.
    from autopar.cost_model.memory import fsdp_accumulates_grads, layer_state

    cfg = ParallelConfig(dp=4, micro_batch=1, global_batch=16, zero=1)
    assert fsdp_accumulates_grads(cfg)
    assert layer_state(1000.0, cfg).grad_bytes == 4000.0
    one = ParallelConfig(dp=4, micro_batch=4, global_batch=16, zero=1)  # one micro-batch
    assert not fsdp_accumulates_grads(one)
    assert layer_state(1000.0, one).grad_bytes == 1000.0


def test_allocator_fragmentation_scales_churning_memory_only() -> None:
    cfg = _cfg(dp=2, micro_batch=2)
    exact = _block(build_cost_table(PROFILE, CLUSTER, cfg, EXACT))
    charged = _block(build_cost_table(PROFILE, CLUSTER, cfg, "autopar"))
    f = 1 + get_framework("autopar").fragmentation_fraction
    assert charged.act_bytes[0] == pytest.approx(f * exact.act_bytes[0])
    assert charged.transient_bytes[2] == pytest.approx(f * exact.transient_bytes[2])
    assert charged.static_bytes == exact.static_bytes
    # CPU runs have no caching allocator: their exact live bytes are charged.
    cpu = Cluster.preset("cpu", gpus_per_node=2)
    cpu_cfg = ParallelConfig(dp=2, micro_batch=2, global_batch=16, dtype="fp32")
    assert (_block(build_cost_table(PROFILE, cpu, cpu_cfg, "autopar")).act_bytes
            == _block(build_cost_table(PROFILE, cpu, cpu_cfg, EXACT)).act_bytes)
