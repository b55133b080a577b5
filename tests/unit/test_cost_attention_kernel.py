"""The attention kernel a framework runs: FlashAttention-2's rate on Hopper against the fused
kernels the matmul curve stands for (compute.attention_ratio, precision.layer_peak_flops)."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.config import ParallelConfig
from autopar.cost_model.compute import attention_ratio, matmul_efficiency
from autopar.cost_model.frameworks import FRAMEWORKS, framework_cluster, get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.layer_terms import framework_layer
from autopar.cost_model.presets import H100_FLASH2_ATTENTION_RATIO
from tests.fixtures.profiles import analytic_transformer_profile

H100 = Cluster.preset("h100", nodes=1)


def test_flash2_is_slower_on_hopper_only():
    assert attention_ratio(H100.device, "flash2", "sdpa") == H100_FLASH2_ATTENTION_RATIO
    assert 0.6 < H100_FLASH2_ATTENTION_RATIO < 0.65  # FA2 333 of cuDNN 529 TFLOP/s (FA3 Fig. 5)
    assert attention_ratio(H100.device, "fused", "sdpa") == 1.0
    assert attention_ratio(H100.device, "flash2", "eager") == 1.0  # score matmuls are matmuls
    for gpu in ("a100-80g", "h200"):  # FA2 is A100's kernel; the H200 curve was measured on it
        assert attention_ratio(Cluster.preset(gpu, nodes=1).device, "flash2", "sdpa") == 1.0


def test_every_framework_names_its_attention_kernel():
    for name in FRAMEWORKS:
        fw = get_framework(name)
        assert fw.attention_kernel in ("fused", "flash2")
        assert fw.sources["attention_kernel"].startswith(("sourced:", "measured:"))
    with pytest.raises(ValueError, match="attention_kernel"):
        dataclasses.replace(get_framework("torchtitan"), attention_kernel="flash9")


@pytest.mark.parametrize("seq_len", [2048, 32768])
def test_a_block_pays_the_attention_core_at_the_kernels_rate(seq_len):
    """The block's forward under FlashAttention-2 exceeds the fused kernel's by exactly its
    attention FLOPs at (1 / ratio - 1) of the layer's rate; longer sequences pay more."""
    profile = analytic_transformer_profile(2, 4096, 32, 32000, seq_len, gated_mlp=True,
                                           kv_heads=8, dropout=False)
    cfg = ParallelConfig(dp=8, global_batch=32, micro_batch=4)
    flash2 = get_framework("torchtitan")
    fused = dataclasses.replace(flash2, attention_kernel="fused")
    slow, fast = (build_cost_table(profile, H100, cfg, fw).layers for fw in (flash2, fused))
    index = next(i for i, x in enumerate(profile.layers) if x.kind == "block")
    block = profile.layers[index]
    attn = 4 * block.recompute_flops["selective"]  # the attention core (4 samples)
    device = framework_cluster(H100, flash2).device  # the framework's kernel efficiency
    rate = device.peak_bf16_flops * matmul_efficiency(device, 4 * block.fwd_flops)
    extra = attn / rate * (1 / H100_FLASH2_ATTENTION_RATIO - 1)
    fwd = [c.compute_s - c.backward_s for c in (slow[index], fast[index])]
    assert fwd[0] - fwd[1] == pytest.approx(extra, rel=1e-6)
    assert slow[index].backward_s > fast[index].backward_s
    embed = next(i for i, x in enumerate(profile.layers) if x.kind != "block")
    assert slow[embed].compute_s == fast[embed].compute_s  # no attention, no change


def test_selective_recompute_reruns_the_attention_core_at_its_own_rate():
    """autopar's selective mode re-runs the attention core alone: under FlashAttention-2 that
    re-run runs at the attention's rate, not at the block's blend of linears and attention."""
    profile = analytic_transformer_profile(2, 4096, 32, 32000, 8192, gated_mlp=True,
                                           kv_heads=8, dropout=False)
    cfg = ParallelConfig(dp=8, global_batch=32, micro_batch=4, recompute="selective")
    flash2 = get_framework("autopar")
    assert flash2.selective_policy == "attention" and flash2.attention_kernel == "flash2"
    fused = dataclasses.replace(flash2, attention_kernel="fused")
    slow, fast = (build_cost_table(profile, H100, cfg, fw).layers for fw in (flash2, fused))
    index = next(i for i, x in enumerate(profile.layers) if x.kind == "block")
    block = profile.layers[index]
    attn = 4 * block.recompute_flops["selective"]
    device = framework_cluster(H100, flash2).device
    rate = device.peak_bf16_flops * matmul_efficiency(device, 4 * block.fwd_flops)
    extra = attn / rate * (1 / H100_FLASH2_ATTENTION_RATIO - 1)
    assert slow[index].recompute_s[1] - fast[index].recompute_s[1] == pytest.approx(extra,
                                                                                   rel=1e-6)


def _keeps_less(profile, block, lean, plain, dropped: int) -> list:
    """``lean`` keeps ``dropped`` bytes of ``block`` less per sample than ``plain`` without and
    with selective recompute (full keeps the block's input only), and ``plain`` keeps the
    profile's count; under tp 2 and cp 2 with micro-batch 2 (one sample's worth a rank) the
    cost table's activations differ by that much, fragmentation included. Returns the (lean,
    plain) cost-table rows of both splits."""
    assert framework_layer(block, lean).saved_bytes == {
        "none": block.saved_bytes["none"] - dropped,
        "selective": block.saved_bytes["selective"] - dropped,
        "full": block.saved_bytes["full"]}
    assert framework_layer(block, plain) == block
    cluster = Cluster.preset("h100", nodes=1)
    index = profile.layers.index(block)
    rows = []
    for cfg in (ParallelConfig(dp=2, tp=2, pp=2, global_batch=16, micro_batch=2),
                ParallelConfig(dp=2, cp=2, pp=2, global_batch=16, micro_batch=2)):
        a, b = (build_cost_table(profile, cluster, cfg, fw).layers[index] for fw in (lean, plain))
        kept = dropped * (1 + lean.fragmentation_fraction)
        assert b.act_bytes[0] - a.act_bytes[0] == pytest.approx(kept)
        assert a.act_bytes[2] == b.act_bytes[2]
        rows.append((a, b))
    return rows


def test_fused_swiglu_keeps_no_activated_gate():
    """The profiler counts SwiGLU's activated gate (silu's saved output: s f elements per
    sample); Megatron-LM's fused kernel recomputes it, so its blocks keep that much less
    (tensor-parallel sharded, cp-local), and nothing else changes."""
    import autopar

    profile = autopar.profile(autopar.models.build(
        "llama", layers=2, hidden=256, heads=8, kv_heads=2, vocab=512, seq_len=64,
        ffn_hidden=512))
    block = next(x for x in profile.layers if x.kind == "block")
    assert block.swiglu_saved_bytes == 64 * 512 * 2  # bf16
    gpt = autopar.profile(autopar.models.build("gpt", layers=2, hidden=256, heads=8,
                                               vocab=512, seq_len=64))
    assert all(x.swiglu_saved_bytes == 0 for x in gpt.layers)
    assert get_framework("megatron-lm").fused_swiglu
    assert not get_framework("torchtitan").fused_swiglu
    fused = dataclasses.replace(get_framework("megatron-lm"), native_gqa=False)  # SwiGLU alone
    eager = dataclasses.replace(fused, fused_swiglu=False)
    for a, b in _keeps_less(profile, block, fused, eager, block.swiglu_saved_bytes):
        gate = block.swiglu_saved_bytes * (1 + fused.fragmentation_fraction)
        assert b.act_bytes[1] - a.act_bytes[1] == pytest.approx(gate)


def test_native_gqa_keeps_no_repeated_kv():
    """A framework whose attention kernel reads the kv heads in place (Megatron-LM's Transformer
    Engine, torchtitan's enable_gqa) keeps K and V once: a block keeps the profiler's repeated
    copies less (tensor-parallel sharded, cp-local); autopar's runtime repeats them."""
    import autopar

    profile = autopar.profile(autopar.models.build(
        "llama", layers=2, hidden=256, heads=8, kv_heads=2, vocab=512, seq_len=64))
    block = next(x for x in profile.layers if x.kind == "block")
    assert block.kv_repeat_saved_bytes == 2 * 64 * 256 * 2 * 3 // 4  # K, V; bf16; 3 of 4 copies
    assert get_framework("torchtitan").native_gqa and get_framework("megatron-lm").native_gqa
    native = dataclasses.replace(get_framework("megatron-lm"), fused_swiglu=False)  # GQA alone
    assert not get_framework("autopar").native_gqa and not get_framework("deepspeed").native_gqa
    repeated = dataclasses.replace(native, native_gqa=False)
    _keeps_less(profile, block, native, repeated, block.kv_repeat_saved_bytes)


def test_fp8_linears_keep_their_fp8_input_under_transformer_engine():
    """Megatron-LM's fp8 linears (Transformer Engine) keep their fp8 input for the weight
    gradient: what only linears save at half, plus an fp8 copy of what they share; memory only
    (the casts and elementwise passes are the 16-bit ones); torchtitan's torchao keeps the
    16-bit input; nothing changes at bf16 or for the head."""
    import autopar

    profile = autopar.profile(autopar.models.build(
        "llama", layers=2, hidden=256, heads=8, kv_heads=2, vocab=512, seq_len=64))
    block = next(x for x in profile.layers if x.kind == "block")
    index = profile.layers.index(block)
    te = get_framework("megatron-lm")
    assert te.fp8_saves_inputs and not get_framework("torchtitan").fp8_saves_inputs
    hp = dataclasses.replace(te, fp8_saves_inputs=False)
    (only, _), (shared, _) = block.linear_saved_bytes, block.linear_shared_bytes
    cfg = ParallelConfig(dp=2, pp=2, global_batch=16, micro_batch=2, dtype="fp8")
    a, b = (build_cost_table(profile, H100, cfg, fw).layers[index] for fw in (te, hp))
    kept = 2 * (only - shared) // 2 * (1 + te.fragmentation_fraction)  # micro-batch 2
    assert b.act_bytes[0] - a.act_bytes[0] == pytest.approx(kept)
    assert b.act_bytes[1] - a.act_bytes[1] == pytest.approx(kept)
    assert a.act_bytes[2] == b.act_bytes[2]
    assert a.compute_s == b.compute_s  # memory only
    bf16 = dataclasses.replace(cfg, dtype="bf16")
    assert (build_cost_table(profile, H100, bf16, te).layers[index].act_bytes
            == build_cost_table(profile, H100, bf16, hp).layers[index].act_bytes)
    head = len(profile.layers) - 1
    assert (build_cost_table(profile, H100, cfg, te).layers[head].act_bytes
            == build_cost_table(profile, H100, cfg, hp).layers[head].act_bytes)
