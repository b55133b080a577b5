"""Tensor parallelism of Hugging Face blocks whose names do not tell the whole story: GLM-4's
fused gate_up_proj (its MLP stays whole, graph/tp.py), Qwen3's and Gemma 3's per-head q_norm and
k_norm and gpt-oss's attention sinks (split with their heads), OLMo 2's q_norm and k_norm across
all heads (split with the features, their statistics all-reduced), and a split module's own
parameter of any other shape (refused before launch, runtime/tp_checks.py)."""

from __future__ import annotations

import pytest

from autopar.errors import AutoparError
from autopar.graph.tp import block_tp
from autopar.runtime.apply import check_plan_runnable
from tests.unit.test_runtime_checks import _plan

pytest.importorskip("transformers")

_BASE = {"hidden_size": 32, "intermediate_size": 64, "head_dim": 8, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
         "max_position_embeddings": 16, "tie_word_embeddings": False}


def _model(model_type: str, **extra):
    from autopar.models.hf import from_hf_config

    return from_hf_config({**_BASE, "model_type": model_type, **extra})


def test_a_down_projection_without_its_input_projection_stays_whole():
    glm = _model("glm4", pad_token_id=None)  # mlp: gate_up_proj (fused, unmarked), down_proj
    tp = block_tp(glm, "model.layers.0", heads=4, kv_heads=2, seq_len=8, dtype_bytes=2)
    assert tp.colwise == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    assert tp.rowwise == ("model.layers.0.self_attn.o_proj",)
    assert tp.allreduce_fwd_bytes == 8 * 32 * 2  # one row-parallel output of width h
    llama = block_tp(_model("llama"), "model.layers.0", heads=4, kv_heads=2, seq_len=8,
                     dtype_bytes=2)
    assert "model.layers.0.mlp.down_proj" in llama.rowwise
    assert llama.allreduce_fwd_bytes == 2 * 8 * 32 * 2
    check_plan_runnable(glm, _plan(tp=2))


def test_a_split_modules_own_parameter_across_heads_refuses_tp_before_launch():
    import torch
    from torch import nn

    model = _model("llama")
    attention = model.get_submodule("model.layers.0.self_attn")
    attention.register_parameter("mix", nn.Parameter(torch.ones(3)))  # not one per head
    with pytest.raises(AutoparError, match="its own parameter 'mix'"):
        check_plan_runnable(model, _plan(tp=2))
    check_plan_runnable(model, _plan(pp=2))


def test_per_head_parameters_split_with_their_heads():
    """gpt-oss's attention sinks, one value per head, split with the heads
    (graph.tp.per_head_params; runtime tp_styles.shard_head_params)."""
    from autopar.graph.tp import per_head_params, split_blocker

    model = _model("gpt_oss", num_local_experts=4, num_experts_per_tok=2)
    assert per_head_params(model.get_submodule("model.layers.0.self_attn")) == ["sinks"]
    assert split_blocker(model, ["model.layers.0.self_attn"]) == ""
    check_plan_runnable(model, _plan(tp=2))


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_per_head_norms_split_with_their_heads(model_type):
    from autopar.graph.tp import per_head_norms, split_blocker

    model = _model(model_type)
    attention = model.get_submodule("model.layers.0.self_attn")
    assert per_head_norms(attention) == ["q_norm", "k_norm"]
    assert split_blocker(model, ["model.layers.0.self_attn"]) == ""
    check_plan_runnable(model, _plan(tp=2))
    check_plan_runnable(model, _plan(tp=2, sequence_parallel=True))


def test_norms_over_all_heads_split_with_the_features():
    """OLMo 2's q_norm (heads * head_dim wide) and k_norm (kv_heads * head_dim) normalise a
    split linear's whole output: split with it (graph.tp.width_norms), not sequence-parallel,
    and not a blocker."""
    from autopar.graph.tp import width_norms

    model = _model("olmo2")
    attention = model.get_submodule("model.layers.0.self_attn")
    assert width_norms(attention) == ["q_norm", "k_norm"]
    assert width_norms(_model("qwen3").get_submodule("model.layers.0.self_attn")) == []
    tp = block_tp(model, "model.layers.0", heads=4, kv_heads=2, seq_len=8, dtype_bytes=2)
    assert tp.width_norms == ("model.layers.0.self_attn.k_norm",
                              "model.layers.0.self_attn.q_norm")
    assert not set(tp.width_norms) & set(tp.sequence) and tp.split_blocker == ""
    check_plan_runnable(model, _plan(tp=2))
