"""FLOPs and saved bytes of zoo blocks against the closed forms (formulas.md sections 1-2)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.models import build

# Small random shapes: head_dim in {32, 64}, heads 2..6 (hidden >= 64, where the few bytes outside
# Korthikanti's count stay under 2%), seq 16..64.
shapes = st.tuples(
    st.sampled_from([32, 64]), st.integers(2, 6), st.sampled_from([16, 32, 48, 64])
).map(lambda t: {"hidden": t[0] * t[1], "heads": t[1], "seq_len": t[2]})


def _gpt(shape: dict, **kw) -> autopar.ModelProfile:
    model = build("gpt", layers=2, vocab=96, **shape, **kw)
    return autopar.profile(model)


@settings(max_examples=3, deadline=None)
@given(shape=shapes, attention=st.sampled_from(["sdpa", "eager"]))
def test_gpt_block_flops_match_megatron(shape: dict, attention: str) -> None:
    prof = _gpt(shape, attention=attention)
    s, h, v = shape["seq_len"], shape["hidden"], 96
    block = prof.layers[1]
    # formulas.md 1.2: forward 24 s h^2 + 4 s^2 h per sample; backward 2x forward.
    expected = 24 * s * h * h + 4 * s * s * h
    assert block.fwd_flops == pytest.approx(expected, rel=0.01)
    assert block.bwd_flops == pytest.approx(2 * block.fwd_flops, rel=1e-9)
    assert block.recompute_flops == {
        "none": 0.0,
        "selective": 4 * s * s * h,
        "full": block.fwd_flops,
    }
    head = prof.layers[-1]
    assert head.fwd_flops == pytest.approx(2 * s * h * v, rel=0.01)  # logits 2 s h V
    assert head.bwd_flops == pytest.approx(2 * head.fwd_flops, rel=0.01)


# Bytes the GPT block saves that Korthikanti's count leaves out: LayerNorm mean and rstd (fp32,
# 2 norms x 2 x 4 bytes per token) and, for the fused kernel, its log-sum-exp (fp32 per head).
def _extras(s: int, heads: int, sdpa: bool) -> int:
    return 16 * s + (4 * heads * s if sdpa else 0)


@settings(max_examples=3, deadline=None)
@given(shape=shapes)
def test_gpt_saved_eager_dropout_is_korthikanti(shape: dict) -> None:
    s, h, a = shape["seq_len"], shape["hidden"], shape["heads"]
    block = _gpt(shape, attention="eager", dropout=0.1).layers[1]
    korthikanti = s * h * (34 + 5 * a * s / h)  # formulas.md section 2, 16-bit, b = 1
    assert block.saved_bytes["none"] == pytest.approx(korthikanti, rel=0.02)
    assert block.saved_bytes["none"] == korthikanti + _extras(s, a, sdpa=False)
    # Replicated under tp: norm inputs, colwise inputs, the two residual dropout masks: 10 s h.
    assert block.saved_bytes_replicated["none"] == 10 * s * h + 16 * s
    # Selective: the 5 a s^2 attention-core terms go; full: the 2 s h layer input only.
    assert block.saved_bytes["selective"] == pytest.approx(34 * s * h, rel=0.02)
    assert block.saved_bytes["full"] == 2 * s * h
    assert block.saved_bytes_replicated["selective"] == 10 * s * h + 16 * s


@settings(max_examples=3, deadline=None)
@given(shape=shapes)
def test_gpt_saved_eager_without_dropout(shape: dict) -> None:
    s, h, a = shape["seq_len"], shape["hidden"], shape["heads"]
    block = _gpt(shape, attention="eager", dropout=0.0).layers[1]
    # No masks; the softmax output is saved once for both of its uses.
    expected = 32 * s * h + 2 * a * s * s
    assert block.saved_bytes["none"] == pytest.approx(expected, rel=0.02)
    assert block.saved_bytes["none"] == expected + _extras(s, a, sdpa=False)
    assert block.saved_bytes["selective"] == 32 * s * h + 16 * s
    assert block.saved_bytes_replicated["none"] == 8 * s * h + 16 * s


@settings(max_examples=3, deadline=None)
@given(shape=shapes)
def test_gpt_saved_sdpa_has_no_square_term(shape: dict) -> None:
    s, h, a = shape["seq_len"], shape["hidden"], shape["heads"]
    block = _gpt(shape, attention="sdpa").layers[1]
    assert block.saved_bytes["none"] == pytest.approx(32 * s * h, rel=0.02)
    assert block.saved_bytes["none"] == 32 * s * h + _extras(s, a, sdpa=True)
    # Selective drops only what the kernel alone keeps (log-sum-exp); q, k, v, out stay.
    assert block.saved_bytes["selective"] == 32 * s * h + 16 * s
    assert block.saved_bytes["full"] == 2 * s * h
    assert block.output_bytes == 2 * s * h


def test_bytes_scale_with_dtype() -> None:
    model = build("gpt", layers=1, hidden=64, heads=4, vocab=96, seq_len=32)
    bf16 = autopar.profile(model)
    fp32 = autopar.profile(model, dtype=torch.float32)
    assert fp32.dtype == "fp32" and bf16.dtype == "bf16"
    assert fp32.layers[1].param_bytes == 2 * bf16.layers[1].param_bytes
    assert fp32.layers[1].saved_bytes["full"] == 2 * bf16.layers[1].saved_bytes["full"]
    assert fp32.layers[1].fwd_flops == bf16.layers[1].fwd_flops


def test_head_keeps_fp32_logits() -> None:
    s, h, v = 32, 64, 96
    head = autopar.profile(build("gpt", layers=1, hidden=h, heads=4, vocab=v, seq_len=s)).layers[-1]
    # norm input 2sh + stats 8s, lm-head input 2sh, fp32 log-probabilities 4sV, int64 labels 8s.
    assert head.saved_bytes["none"] == 2 * s * h + 8 * s + 2 * s * h + 4 * s * v + 8 * s
    # The logits are vocab-sharded: only the norm side is replicated.
    assert head.saved_bytes_replicated["none"] == 4 * s * h + 8 * s + 8 * s


def test_llama_block_swiglu_and_gqa() -> None:
    s, h, a, kv, f = 32, 128, 4, 2, 256
    prof = autopar.profile(
        build("llama", layers=2, hidden=h, heads=a, kv_heads=kv, ffn_hidden=f, vocab=96, seq_len=s)
    )
    block = prof.layers[1]
    d = h // a
    # q, o: 2 s h^2 each; k, v: 2 s h (kv d) each; SwiGLU 3 x 2 s h f; attention 4 s^2 h.
    expected = 4 * s * h * h + 4 * s * h * kv * d + 6 * s * h * f + 4 * s * s * h
    assert block.fwd_flops == pytest.approx(expected, rel=0.01)
    assert (prof.heads, prof.kv_heads, prof.ffn_hidden) == (a, kv, f)
    assert block.tp.heads == a and block.tp.kv_heads == kv
    # Saved at 16-bit: norm inputs 2 x 2sh, q/k/v projection and MLP inputs 2 x 2sh, q, k, v after
    # RoPE and the GQA repeat (full heads) 3 x 2sh, attention output 2sh; SwiGLU keeps w1 out, silu
    # out, w3 out and the w2 input, 4 x 2sf; plus RMSNorm 1/rms (2 x 4s) and log-sum-exp (4as).
    assert block.saved_bytes["none"] == 16 * s * h + 8 * s * f + 8 * s + 4 * a * s
    assert block.saved_bytes["selective"] == 16 * s * h + 8 * s * f + 8 * s
    assert block.saved_bytes_replicated["none"] == 8 * s * h + 8 * s
    assert block.saved_bytes["full"] == 2 * s * h


def test_gqa_repeated_kv_counted() -> None:
    """The zoo repeats a grouped-query block's K and V up to the query heads before the kernel;
    the profiler counts the saved copies beyond one (2 x 2sh x (1 - kv / a)) and nothing for
    multi-head attention (kv = a)."""
    s, h, a = 32, 128, 8
    for kv in (1, 2, 4, 8):
        prof = autopar.profile(build("llama", layers=1, hidden=h, heads=a, kv_heads=kv,
                                     vocab=96, seq_len=s))
        block = prof.layers[1]
        assert block.kv_repeat_saved_bytes == 2 * 2 * s * h * (a - kv) // a
        assert block.kv_repeat_saved_bytes < block.saved_bytes["selective"]


def test_linear_inputs_counted_by_who_keeps_them() -> None:
    """What only weight matmuls keep (a GPT block: both norm outputs and the GELU output, 12 s h
    bytes, the norm outputs replicated) and what a linear shares with another op (the attention
    output, which the attention's backward keeps too: 2 s h)."""
    s, h = 32, 64
    gpt = build("gpt", layers=1, hidden=h, heads=4, vocab=96, seq_len=s)
    block = autopar.profile(gpt).layers[1]
    assert block.linear_saved_bytes == (12 * s * h, 4 * s * h)
    assert block.linear_shared_bytes == (2 * s * h, 0)
    f = 96
    llama = autopar.profile(build("llama", layers=1, hidden=h, heads=4, kv_heads=2, ffn_hidden=f,
                                  vocab=96, seq_len=s)).layers[1]
    # w1 and w3 share one input; w2 takes the SwiGLU product (2 s f)
    assert llama.linear_saved_bytes == (4 * s * h + 2 * s * f, 4 * s * h)
