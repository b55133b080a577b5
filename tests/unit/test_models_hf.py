"""HF adapter: transformers models from configs on meta, no download; sizes and layout."""

from __future__ import annotations

import sys

import pytest
import torch

from autopar.errors import AutoparError, UnknownModelError

pytest.importorskip("transformers")

from autopar.models import from_hf_config, hf_tp_structure
from autopar.models.hf import load_hf_config

TINY = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
    max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def test_gpt2_matches_megatron_closed_form():
    L, h, V, s = 3, 48, 100, 40
    model = from_hf_config(
        {"model_type": "gpt2", "n_layer": L, "n_embd": h, "n_head": 4, "vocab_size": V,
         "n_positions": s, "bos_token_id": 1, "eos_token_id": 2}
    )  # fmt: skip
    assert next(model.parameters()).device.type == "meta"
    # Megatron-LM SC'21 eq. 2 (12 L h^2 + 13 L h + (V + s) h) plus the final LayerNorm (tied head).
    assert model.num_parameters() == 12 * L * h * h + 13 * L * h + (V + s) * h + 2 * h
    info = hf_tp_structure(model)
    assert (info.hidden, info.heads, info.kv_heads, info.vocab) == (h, 4, 4, V)
    assert (info.num_layers, info.layers_fqn, info.ffn_hidden) == (L, "transformer.h", 4 * h)
    assert info.tied_embeddings and info.lm_head_fqn == "lm_head"
    assert info.fused == ("attn.c_attn",) and info.rowwise == ("attn.c_proj", "mlp.c_proj")


def test_llama_matches_zoo_closed_form():
    L, h, a, kv, f, V = 2, 64, 8, 2, 96, 200
    config = {"model_type": "llama", "hidden_size": h, "num_hidden_layers": L,
              "num_attention_heads": a, "num_key_value_heads": kv, "intermediate_size": f,
              "vocab_size": V, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    model = from_hf_config(config)
    d = h // a
    closed_form = L * (2 * h * h + 2 * h * kv * d + 3 * h * f + 2 * h) + 2 * V * h + h
    assert model.num_parameters() == closed_form
    assert not model.config.use_cache
    info = hf_tp_structure(model)
    assert (info.kv_heads, info.ffn_hidden, info.layers_fqn) == (kv, f, "model.layers")
    assert info.colwise == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                            "mlp.gate_proj", "mlp.up_proj")  # fmt: skip
    assert info.rowwise == ("self_attn.o_proj", "mlp.down_proj")
    assert info.embedding_fqn == "model.embed_tokens" and not info.tied_embeddings
    # The zoo's llama of the same shape has the same count.
    from autopar.models import build

    zoo = build("llama", layers=L, hidden=h, heads=a, kv_heads=kv, ffn_hidden=f, vocab=V,
                seq_len=8)  # fmt: skip
    assert sum(p.numel() for p in zoo.parameters()) == model.num_parameters()


def test_real_device_build_is_seeded_and_trains():
    config = {"model_type": "llama", **TINY, "intermediate_size": 64}
    a = from_hf_config(config, device="cpu", seed=0)
    b = from_hf_config(config, device="cpu", seed=0)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    ids = torch.randint(3, 128, (2, 8))
    out = a(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("mistral", {"num_key_value_heads": 2, "intermediate_size": 64}),
        ("qwen2", {"num_key_value_heads": 2, "intermediate_size": 64}),
        ("gemma", {"num_key_value_heads": 2, "intermediate_size": 64, "head_dim": 8}),
        ("phi3", {"num_key_value_heads": 2, "intermediate_size": 64}),
        ("falcon", {}),
        ("gpt_neox", {"intermediate_size": 64}),
        ("opt", {"ffn_dim": 64}),
        ("mixtral", {"num_key_value_heads": 2, "intermediate_size": 64, "num_local_experts": 4}),
        ("qwen2_moe", {"num_key_value_heads": 2, "intermediate_size": 64,
                       "moe_intermediate_size": 16, "num_experts": 4}),
    ],
)
def test_other_families_build_on_meta(model_type, extra):
    model = from_hf_config({"model_type": model_type, **TINY, **extra})
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    info = hf_tp_structure(model)
    assert (info.hidden, info.heads, info.vocab, info.num_layers) == (32, 4, 128, 2)
    assert info.colwise or info.fused
    assert info.rowwise


def test_path_and_config_object(tmp_path):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **TINY, "intermediate_size": 64}))
    by_path = from_hf_config(path)
    by_dir = from_hf_config(tmp_path)
    by_object = from_hf_config(load_hf_config(path))
    assert by_path.num_parameters() == by_dir.num_parameters() == by_object.num_parameters()


def test_errors(monkeypatch, tmp_path):
    with pytest.raises(UnknownModelError, match="Did you mean 'llama'"):
        from_hf_config({"model_type": "lama"})
    with pytest.raises(UnknownModelError, match="needs a 'model_type'"):
        from_hf_config({"hidden_size": 8})
    with pytest.raises(AutoparError, match="cannot read HF config"):
        from_hf_config(tmp_path / "missing.json")
    with pytest.raises(AutoparError, match="no causal-LM model"):
        from_hf_config({"model_type": "vit"})
    # transformers accepts the config but cannot build from it: the config is what to fix.
    with pytest.raises(AutoparError, match=r"cannot build a llama model .*Padding_idx.*fix the"):
        from_hf_config({**TINY, "model_type": "llama", "pad_token_id": 500})
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(AutoparError, match=r"pip install 'autopar\[hf\]'"):
        from_hf_config({"model_type": "llama"})
