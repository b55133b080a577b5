"""Zoo models: parameter counts against closed forms, presets, errors, real-device runs."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.errors import UnknownModelError
from autopar.models import build, cross_entropy_loss, list_presets, make_spec, num_params


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) parameters once


def megatron_eq2(L: int, h: int, V: int, s: int) -> Fraction:
    # Megatron-LM SC'21 eq. 2 (formulas.md 1.1), evaluated literally in exact arithmetic.
    return 12 * L * h**2 * (1 + Fraction(13, 12 * h) + Fraction(V + s, 12 * L * h))


def llama_closed_form(L: int, h: int, a: int, kv: int, f: int, V: int, tied: bool) -> int:
    # per block: wq, wo (h^2 each); wk, wv (h * kv * h/a each); w1, w2, w3 (h f each); 2 RMSNorm (h)
    # outside: embedding V h, final RMSNorm h, untied head V h.
    d = h // a
    return L * (2 * h * h + 2 * h * kv * d + 3 * h * f + 2 * h) + V * h + h + (0 if tied else V * h)


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 4),
    a=st.integers(1, 6),
    d=st.integers(1, 12),
    V=st.integers(1, 300),
    s=st.integers(1, 64),
    tied=st.booleans(),
)
def test_gpt_params_equal_megatron_eq2(L, a, d, V, s, tied):
    h = a * d
    model = build("gpt", layers=L, hidden=h, heads=a, vocab=V, seq_len=s, tie_embeddings=tied)
    expected = megatron_eq2(L, h, V, s) + 2 * h + (0 if tied else V * h)
    assert expected.denominator == 1
    assert count(model) == expected == num_params(model.autopar_spec)


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 3), kv=st.integers(1, 4), group=st.integers(1, 4), d=st.integers(1, 8),
       f=st.integers(1, 100), V=st.integers(1, 300), s=st.integers(1, 32))
def test_gpt_with_grouped_query_attention_counts_its_narrower_k_and_v(L, kv, group, d, f, V, s):
    """A GPT block with fewer kv heads (Nemotron-4's): wk and wv (and their biases) are
    kv_heads * head_dim wide; the closed form equals the built model."""
    a, h = kv * group, kv * group * d
    model = build("gpt", layers=L, hidden=h, heads=a, kv_heads=kv, ffn_hidden=f, vocab=V,
                  seq_len=s)
    k = kv * d
    attention = 2 * h * h + 2 * h * k + 2 * h + 2 * k
    expected = L * (attention + 2 * h * f + f + h + 4 * h) + (V + s) * h + 2 * h + V * h
    assert count(model) == expected == num_params(model.autopar_spec)
    assert model.layers["0"].attention.wk.weight.shape == (k, h)


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 4),
    kv=st.integers(1, 4),
    group=st.integers(1, 4),
    half_d=st.integers(1, 6),
    f=st.integers(1, 200),
    V=st.integers(1, 300),
    tied=st.booleans(),
)
def test_llama_params_equal_closed_form(L, kv, group, half_d, f, V, tied):
    a = kv * group
    h = a * 2 * half_d
    model = build(
        "llama", layers=L, hidden=h, heads=a, kv_heads=kv, ffn_hidden=f, vocab=V, seq_len=8,
        tie_embeddings=tied,
    )  # fmt: skip
    assert count(model) == llama_closed_form(L, h, a, kv, f, V, tied)
    assert count(model) == num_params(model.autopar_spec)


@settings(max_examples=10, deadline=None)
@given(L=st.integers(1, 4), h=st.integers(1, 40), f=st.integers(1, 90), V=st.integers(1, 200))
def test_mlp_params(L, h, f, V):
    model = build("mlp", layers=L, hidden=h, ffn_hidden=f, vocab=V, seq_len=4)
    assert count(model) == L * (2 * h * f + f + h) + V * h + 2 * h + V * h


@pytest.mark.parametrize(
    ("name", "billions"),
    [("gpt3-175b", 174.6), ("llama3-405b", 405.9), ("llama3-8b", 8.03), ("llama2-70b", 68.98),
     ("llama2-7b", 6.74), ("gpt2", 0.124), ("gpt2-xl", 1.558)],
)  # fmt: skip
def test_preset_param_counts(name, billions):
    model = build(name)
    digits = len(str(billions).split(".")[1])
    assert round(count(model) / 1e9, digits) == billions


def test_list_presets():
    presets = list_presets()
    assert len(presets) == 21  # 18 dense, 3 mixture-of-experts
    for name, line in presets.items():
        spec = make_spec(name)
        assert f"{num_params(spec) / 1e9:.2f}B params" in line, name
        assert "\n" not in line
    # Closed forms are checked against built models above; spot-check small presets here too.
    for name in ("gpt2", "gpt3-125m", "llama2-7b"):
        assert count(build(name)) == num_params(make_spec(name))


def test_gpt3_175b_shape_and_seq_override():
    spec = build("gpt3-175b", seq_len=4096).autopar_spec
    assert (spec.layers, spec.hidden, spec.heads, spec.vocab, spec.seq_len) == (
        96, 12288, 96, 51200, 4096,
    )  # fmt: skip
    assert spec.tie_embeddings and spec.name == "gpt3-175b"
    spec = make_spec("llama3-405b")
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn_hidden) == (
        126, 16384, 128, 8, 53248,
    )  # fmt: skip


def test_llama_default_ffn_rule():
    shape = dict(layers=1, vocab=8, seq_len=8)
    assert make_spec("llama", hidden=4096, heads=32, **shape).ffn_hidden == 11008
    assert make_spec("llama", hidden=5120, heads=40, **shape).ffn_hidden == 13824
    assert make_spec("gpt", layers=1, hidden=64, heads=4, vocab=8, seq_len=8).ffn_hidden == 256


def test_405b_builds_on_meta():
    # How fast is benchmarks/profile_speed.py's to print; here: no parameter has storage.
    model = build("llama3-405b")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(405.85e9, rel=1e-3)


def test_fqns_follow_model_structure():
    names = {n for n, _ in build("llama", layers=2, hidden=16, heads=4, kv_heads=2, vocab=8,
                                  seq_len=4).named_modules()}  # fmt: skip
    for fqn in ("tok_embeddings", "layers.1.attention_norm", "layers.0.attention.wq",
                "layers.0.attention.wk", "layers.0.attention.wv", "layers.0.attention.wo",
                "layers.0.ffn_norm", "layers.0.feed_forward.w1", "layers.0.feed_forward.w2",
                "layers.0.feed_forward.w3", "norm", "output"):  # fmt: skip
        assert fqn in names
    gpt = build("gpt", layers=1, hidden=16, heads=4, vocab=8, seq_len=4)
    assert gpt.pos_embeddings.weight.shape == (4, 16)
    assert gpt.layers["0"].attention.wq.bias is not None
    assert not hasattr(gpt.layers["0"].feed_forward, "w3")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(layers=2, hidden=30, heads=4, vocab=8, seq_len=4), "heads=4 must divide hidden=30"),
        (dict(layers=2, hidden=32, heads=4, kv_heads=3, vocab=8, seq_len=4), "kv_heads=3 must"),
        (dict(layers=0, hidden=32, heads=4, vocab=8, seq_len=4), "layers must be a positive"),
        (dict(layers=2, hidden=32, heads=4, vocab=-1, seq_len=4), "vocab must be a positive"),
        (dict(layers=2, hidden=32, heads=4, vocab=8), "needs seq_len"),
        (dict(layers=2, hidden=32, heads=4, vocab=8, seq_len=4, colour=1), "does not take colour"),
        (dict(layers=2, hidden=32, heads=4, vocab=8, seq_len=4, attention="flash"), "attention"),
    ],
)
def test_bad_shapes_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build("llama", **kwargs)


def test_unknown_name_suggests_close_names():
    with pytest.raises(UnknownModelError, match="'gpt3-175b'"):
        build("gpt3-175")
    with pytest.raises(UnknownModelError, match="'llama'"):
        build("lama")


@pytest.mark.parametrize("kind", ["gpt", "llama", "mlp"])
def test_seeded_cpu_build_is_deterministic_and_trains(kind):
    shape = dict(layers=2, hidden=16, vocab=32, seq_len=8)
    if kind != "mlp":
        shape["heads"] = 4
    if kind == "llama":
        shape["kv_heads"] = 2
    a = build(kind, device="cpu", seed=7, **shape)
    b = build(kind, device="cpu", seed=7, **shape)
    c = build(kind, device="cpu", seed=8, **shape)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.output.weight, c.output.weight)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = a(tokens)
    assert logits.shape == (2, 8, 32) and logits.dtype == torch.float32
    loss = cross_entropy_loss(logits, tokens)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in a.parameters())


def test_init_values():
    model = build("gpt", layers=1, hidden=64, heads=4, vocab=512, seq_len=8, device="cpu", seed=0)
    assert torch.all(model.layers["0"].attention.wq.bias == 0)
    assert torch.all(model.norm.weight == 1)
    assert abs(model.tok_embeddings.weight.std().item() - 0.02) < 0.002


def test_sdpa_and_eager_agree():
    for kind, extra in (("gpt", {}), ("llama", {"kv_heads": 2})):
        shape = dict(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, device="cpu", seed=3)
        sdpa = build(kind, **shape, **extra)
        eager = build(kind, attention="eager", **shape, **extra)
        tokens = torch.randint(0, 64, (2, 16))
        torch.testing.assert_close(sdpa(tokens), eager(tokens), rtol=1e-5, atol=1e-5)


def test_attention_is_causal():
    model = build("llama", layers=2, hidden=32, heads=4, vocab=64, seq_len=16, device="cpu", seed=1)
    tokens = torch.randint(0, 64, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 64
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_pipeline_stage_conventions(kind):
    shape = dict(layers=3, hidden=32, heads=4, vocab=64, seq_len=16, device="cpu", seed=5)
    full = build(kind, tie_embeddings=True, **shape)
    first = build(kind, tie_embeddings=True, **shape)
    last = build(kind, tie_embeddings=True, **shape)
    del first.layers["2"]
    first.norm = first.output = None
    del last.layers["0"], last.layers["1"]
    last.tok_embeddings = last.pos_embeddings = None
    tokens = torch.randint(0, 64, (2, 16))
    hidden = first(tokens)
    assert hidden.shape == (2, 16, 32)
    assert list(last.layers) == ["2"]
    torch.testing.assert_close(last(hidden), full(tokens), rtol=0, atol=0)
    # A stage without tok_embeddings keeps the tied head initialised as the embedding.
    torch.testing.assert_close(last.output.weight, full.tok_embeddings.weight, rtol=0, atol=0)


def test_dtype_and_tied_weight():
    model = build("gpt2", dtype=torch.bfloat16)
    assert model.output.weight is model.tok_embeddings.weight
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_cross_entropy_loss_matches_torch():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[0, 1, 2], [3, 4, 0]])
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 5), labels.view(-1))
    torch.testing.assert_close(cross_entropy_loss(logits, labels), expected)
