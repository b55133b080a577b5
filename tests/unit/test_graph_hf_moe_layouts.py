"""Hugging Face mixture-of-experts families beyond the [E, out, in] layout (graph/moe.py):
gpt-oss and Llama 4 store experts [E, in, out], DBRX as w1/v1/w2 matrices, and DeepSeek-V3's
first layers are dense among mixture-of-experts ones (graph/structure.py: blocks of one class)."""

from __future__ import annotations

import pytest
from torch import nn

import autopar
from autopar.graph.structure import find_blocks
from autopar.graph.types import LayerProfile

pytest.importorskip("transformers")

SEQ = 16
H, F_E = 64, 128
_BASE = dict(hidden_size=H, intermediate_size=F_E, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
             tie_word_embeddings=False)


def _profile(config: dict):
    from autopar.models.hf import from_hf_config

    return autopar.profile(from_hf_config(config), seq_len=SEQ)


def _gpt_oss(top_k: int) -> dict:
    return dict(_BASE, model_type="gpt_oss", num_local_experts=4, head_dim=16,
                num_experts_per_tok=top_k)


def _llama4(top_k: int) -> dict:
    return dict(_BASE, model_type="llama4_text", num_local_experts=4, head_dim=16,
                intermediate_size_mlp=2 * F_E, num_experts_per_tok=top_k)


def _dbrx(top_k: int) -> dict:
    return {"model_type": "dbrx", "d_model": H, "n_heads": 4, "n_layers": 1, "max_seq_len": 64,
            "vocab_size": 256, "attn_config": {"clip_qkv": 8, "kv_n_heads": 2, "rope_theta": 10000},
            "ffn_config": {"ffn_hidden_size": F_E, "moe_num_experts": 4, "moe_top_k": top_k}}


# (config for k experts a token, parameters of one expert, shared experts)
_FAMILIES = {
    # gpt-oss: gate_up_proj[E, h, 2 f_e] and down_proj[E, f_e, h], each with a bias.
    "gpt_oss": (_gpt_oss, 3 * H * F_E + 2 * F_E + H, 0),
    # Llama 4: [E, in, out] without biases, called on rows repeated per expert; one shared MLP.
    "llama4_text": (_llama4, 3 * H * F_E, 1),
    # DBRX: w1, v1, w2 of [E f_e, h].
    "dbrx": (_dbrx, 3 * H * F_E, 0),
}


def _block(config: dict) -> LayerProfile:
    return _profile(config).layers[1]


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_hf_expert_layouts_count_k_experts_a_token(family):
    make, expert_params, shared = _FAMILIES[family]
    one, two = _block(make(1)), _block(make(2))
    # One more routed expert a token costs one expert's SwiGLU: 2 * 3 h f_e FLOPs a token.
    assert two.fwd_flops - one.fwd_flops == pytest.approx(6 * SEQ * H * F_E, rel=1e-6)
    assert two.bwd_flops - one.bwd_flops == pytest.approx(2 * 6 * SEQ * H * F_E, rel=1e-6)
    moe = two.moe
    assert moe is not None
    assert (moe.experts, moe.top_k, moe.hidden, moe.expert_hidden) == (4, 2, H, F_E)
    assert moe.expert_params == expert_params and moe.shared_experts == shared


def test_llama4_counts_routed_rows_not_every_expert_on_every_token():
    """transformers' Llama 4 runs all E experts on every token; a training framework runs the
    k the router picks, which is what the profile counts (4 experts, k = 1: a quarter)."""
    block = _block(_llama4(1))
    routed = 6 * SEQ * H * F_E  # one expert a token
    shared = 6 * SEQ * H * F_E  # the shared expert, intermediate_size wide
    router = 2 * SEQ * H * 4
    dense_rest = _block(dict(_BASE, model_type="llama", head_dim=16)).fwd_flops - 6 * SEQ * H * F_E
    assert block.fwd_flops == pytest.approx(dense_rest + routed + shared + router, rel=0.02)


def test_deepseek_v3_dense_first_layers_are_blocks():
    config = dict(_BASE, model_type="deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1,
                  n_routed_experts=4, moe_intermediate_size=F_E, num_experts_per_tok=2,
                  n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16,
                  q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    layers = _profile(config).layers
    assert [x.kind for x in layers] == ["embedding", "block", "block", "block", "head"]
    assert layers[1].moe is None
    assert layers[2].moe is not None and layers[3].moe == layers[2].moe
    assert layers[2].moe.experts == 4 and layers[2].moe.shared_experts == 1
    # The mixture-of-experts blocks run the shared expert and 2 routed ones where the dense
    # block runs one MLP of intermediate_size (here f_e too): 2 more expert MLPs a token.
    extra = layers[2].fwd_flops - layers[1].fwd_flops
    router = 2 * SEQ * H * 4
    assert extra == pytest.approx(2 * 6 * SEQ * H * F_E + router, rel=0.01)


def test_blocks_are_one_class_whatever_their_insides():
    class Layer(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.mlp = nn.Linear(8, width)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(8), Layer(16), Layer(16)])
            self.other = nn.ModuleList([nn.Linear(8, 8), nn.ReLU()])

    assert find_blocks(Model()) == ("layers", ("layers.0", "layers.1", "layers.2"))
