"""Mixture-of-experts profiles: routed experts counted by formula (graph/moe.py) on meta tensors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.graph.types import LayerProfile
from autopar.models.zoo import make_spec, num_params

SEQ = 16


def _block(**shape) -> LayerProfile:
    model = autopar.models.build(
        "llama", layers=1, heads=2, kv_heads=1, vocab=64, seq_len=SEQ, **shape
    )
    return autopar.profile(model, seq_len=SEQ).layers[1]


@settings(max_examples=2, deadline=None)
@given(
    hidden=st.sampled_from([32, 48]),
    expert_hidden=st.sampled_from([24, 40]),
    experts=st.integers(2, 6),
    data=st.data(),
)
def test_expert_flops_and_params_match_closed_form(hidden, expert_hidden, experts, data):
    top_k = data.draw(st.integers(1, experts))
    moe = _block(hidden=hidden, ffn_hidden=expert_hidden, experts=experts, top_k=top_k)
    dense = _block(hidden=hidden, ffn_hidden=expert_hidden)
    # The dense block runs one SwiGLU of width f_e per token; the MoE block k of them plus the
    # router (E logits per token): extra = (k - 1) 6 s h f_e + 2 s h E.
    mlp = 6 * SEQ * hidden * expert_hidden
    expected = (top_k - 1) * mlp + 2 * SEQ * hidden * experts
    assert moe.fwd_flops - dense.fwd_flops == pytest.approx(expected, rel=0.01)
    assert moe.bwd_flops - dense.bwd_flops == pytest.approx(2 * (top_k - 1) * mlp, rel=0.01,
                                                            abs=4 * SEQ * hidden * experts)
    record = moe.moe
    assert (record.experts, record.top_k, record.hidden, record.expert_hidden) == (
        experts, top_k, hidden, expert_hidden)
    assert record.expert_params == 3 * hidden * expert_hidden
    assert record.routed_fwd_flops(SEQ) == top_k * mlp
    spec = make_spec("llama", layers=1, hidden=hidden, heads=2, kv_heads=1, vocab=64,
                     seq_len=SEQ, ffn_hidden=expert_hidden, experts=experts, top_k=top_k)
    outside = 64 * hidden * 2 + hidden  # embedding, untied head, final norm
    assert moe.num_params == num_params(spec) - outside
    assert moe.num_params - dense.num_params == (experts - 1) * record.expert_params + (
        hidden * experts)


def test_shared_experts_and_capacity_factor():
    base = dict(hidden=32, ffn_hidden=16, experts=4, top_k=2)
    plain = _block(**base)
    shared = _block(**base, shared_experts=2)
    assert shared.moe.shared_experts == 2
    assert shared.fwd_flops - plain.fwd_flops == pytest.approx(2 * 6 * SEQ * 32 * 16, rel=0.01)
    padded = _block(**base, capacity_factor=1.5)
    assert padded.moe.capacity_factor == 1.5
    # Capacity-bound experts run E ceil(c T k / E) rows: 1.5x the routed FLOPs here.
    routed = plain.moe.routed_fwd_flops(SEQ)
    assert padded.fwd_flops - plain.fwd_flops == pytest.approx(0.5 * routed, rel=0.01)


def test_moe_record_round_trips_and_dense_json_unchanged():
    block = _block(hidden=32, ffn_hidden=16, experts=4, top_k=2)
    assert LayerProfile.from_dict(block.to_dict()) == block
    dense = _block(hidden=32, ffn_hidden=16)
    assert dense.moe is None and "moe" not in dense.to_dict()
    assert LayerProfile.from_dict(dense.to_dict()) == dense


def test_zoo_moe_presets_have_published_sizes():
    # Mixtral 8x7B: 46.7B parameters (Jiang et al. 2024); 8x22B: 141B (mistral.ai release).
    assert num_params(make_spec("mixtral-8x7b")) == pytest.approx(46.7e9, rel=0.01)
    assert num_params(make_spec("mixtral-8x22b")) == pytest.approx(141e9, rel=0.01)
    spec = make_spec("deepseek-v3")
    assert (spec.experts, spec.top_k, spec.shared_experts, spec.expert_hidden) == (256, 8, 1, 2048)


def test_moe_options_are_checked():
    with pytest.raises(ValueError, match="top_k"):
        make_spec("llama", layers=1, hidden=32, heads=2, vocab=64, seq_len=8, experts=4, top_k=5)
    with pytest.raises(ValueError, match="need experts"):
        make_spec("llama", layers=1, hidden=32, heads=2, vocab=64, seq_len=8, top_k=2)
    with pytest.raises(ValueError, match="does not take"):
        make_spec("gpt", layers=1, hidden=32, heads=2, vocab=64, seq_len=8, experts=2, top_k=1)


_HF_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                tie_word_embeddings=False)


def _hf_block(config: dict) -> LayerProfile:
    from autopar.models.hf import from_hf_config

    return autopar.profile(from_hf_config(config), seq_len=SEQ).layers[1]


def test_hf_mixtral_is_mistral_plus_k_minus_one_experts():
    pytest.importorskip("transformers")
    dense = _hf_block(dict(model_type="mistral", **_HF_BASE))
    moe = _hf_block(dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                         **_HF_BASE))
    mlp = 6 * SEQ * 64 * 128  # one expert (= the dense MLP) per token
    router = 2 * SEQ * 64 * 4
    assert moe.fwd_flops == pytest.approx(dense.fwd_flops + (2 - 1) * mlp + router, rel=0.01)
    assert moe.moe.expert_params == 3 * 64 * 128 and moe.moe.top_k == 2
    assert moe.num_params == dense.num_params + 3 * moe.moe.expert_params + 64 * 4


def test_hf_qwen2_moe_is_qwen2_plus_experts():
    pytest.importorskip("transformers")
    dense = _hf_block(dict(model_type="qwen2", **_HF_BASE))
    # The shared expert (width 128) is the dense MLP; the routed experts add k more of them.
    moe = _hf_block(dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=128, shared_expert_intermediate_size=128,
                         decoder_sparse_step=1, **_HF_BASE))
    mlp = 6 * SEQ * 64 * 128
    gates = 2 * SEQ * 64 * 4 + 2 * SEQ * 64  # router and the shared expert's sigmoid gate
    assert moe.fwd_flops == pytest.approx(dense.fwd_flops + 2 * mlp + gates, rel=0.01)
    assert moe.moe.shared_experts == 1 and moe.moe.experts == 4


def _reference_experts(module, x, index, weights):
    """The module docstring's rule, token by token: ``sum_k w_k expert_k(x)``, an expert taking
    its assignments in (token, slot) order up to its capacity."""
    import torch

    from autopar.models.moe import expert_capacity

    tokens, top_k = index.shape
    cap = expert_capacity(tokens, top_k, module.num_experts, module.capacity_factor)
    taken = [0] * module.num_experts
    out = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(top_k):
            e = int(index[t, j])
            taken[e] += 1
            if cap and taken[e] > cap:
                continue
            out[t] += weights[t, j] * module.expert_forward(e, x[t : t + 1])[0]
    return out


@settings(max_examples=6, deadline=None)
@given(tokens=st.integers(1, 24), experts=st.integers(1, 6), top_k=st.integers(1, 3),
       capacity_factor=st.sampled_from([0.0, 0.5, 1.0, 1.25]), seed=st.integers(0, 99))
def test_experts_forward_is_the_routed_sum(tokens, experts, top_k, capacity_factor, seed):
    import torch

    from autopar.models.moe import Experts

    top_k = min(top_k, experts)
    gen = torch.Generator().manual_seed(seed)
    module = Experts(8, 6, experts, capacity_factor)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=gen))
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=gen))
    x = torch.randn(tokens, 8, generator=gen, dtype=torch.float64)
    probs = torch.rand(tokens, experts, generator=gen, dtype=torch.float64)
    weights, index = torch.topk(probs, top_k, dim=-1)
    got = module(x, index, weights)
    torch.testing.assert_close(got, _reference_experts(module, x, index, weights))
