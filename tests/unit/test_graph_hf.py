"""HF configs profile on the meta device without download (fx fails on them: the order of
the profiling run's module hooks)."""

from __future__ import annotations

import pytest

import autopar

pytest.importorskip("transformers")
from autopar.models import from_hf_config

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 96,
    "max_position_embeddings": 32,
}
GPT2 = {
    "model_type": "gpt2",
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "vocab_size": 96,
    "n_positions": 32,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def test_hf_llama() -> None:
    model = from_hf_config(LLAMA)
    prof = autopar.profile(model)
    assert prof.num_params == model.num_parameters()
    assert prof.trace_method == "modules" and prof.name == "llama"
    assert (prof.hidden, prof.heads, prof.kv_heads, prof.ffn_hidden, prof.vocab) == (
        64,
        4,
        2,
        128,
        96,
    )
    assert [layer.name for layer in prof.layers] == [
        "embedding",
        "model.layers.0",
        "model.layers.1",
        "head",
    ]
    assert prof.layers[-1].module_fqns == ("model.norm", "lm_head")
    block = prof.layers[1]
    s, h = 32, 64
    # q, o: 2 s h^2; k, v: 2 s h (h/2) (2 of 4 heads); SwiGLU 3 x 2 s h f; attention 4 s^2 h.
    assert block.fwd_flops == pytest.approx(
        4 * s * h * h + 2 * s * h * h + 6 * s * h * 128 + 4 * s * s * h, rel=0.01
    )
    assert block.tp.colwise == tuple(
        f"model.layers.0.{n}"
        for n in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        )
    )
    assert block.tp.rowwise == ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj")
    assert prof.layers[2].repeat_of == "model.layers.0"
    assert prof.layers[0].tp.vocab_parallel == ("model.embed_tokens",)


def test_hf_gpt2() -> None:
    model = from_hf_config(GPT2)
    prof = autopar.profile(model)
    assert prof.num_params == model.num_parameters()
    assert prof.trace_method == "modules" and prof.tied_embeddings
    assert prof.num_blocks == 2 and prof.ffn_hidden == 4 * 64
    block = prof.layers[1]
    s, h = 32, 64
    assert block.fwd_flops == pytest.approx(24 * s * h * h + 4 * s * s * h, rel=0.01)
    # Conv1D linears split like nn.Linear; the fused c_attn column-wise with q, k, v kept apart.
    assert block.tp.colwise == ("transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc")
    assert block.tp.fused_qkv == ("transformer.h.0.attn.c_attn",) and block.tp.heads == 4
    assert block.tp.rowwise == ("transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_proj")
    # Activations inside the split (q/k/v heads, the MLP's inner width) shard over tp now.
    assert block.saved_bytes_replicated["none"] < block.saved_bytes["none"]
    assert prof.layers[-1].fwd_flops == pytest.approx(2 * s * h * 96, rel=0.01)


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_runtime_layout_is_the_planners(config: dict) -> None:
    # One rule: the layout the runtime reads from the modules is the one ``autopar plan`` writes.
    from autopar.runtime.tensor_parallel import default_tp_layout
    from autopar.search.layout import tp_layout

    model = from_hf_config(config)
    planned = tp_layout(autopar.profile(model), tp=2, sequence_parallel=True)
    assert planned == default_tp_layout(model)
    assert "colwise_qkv" in planned.values() or "model.layers.*.self_attn.q_proj" in planned


MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
GPT_OSS = {**LLAMA, "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2,
           "head_dim": 16}


@pytest.mark.parametrize("config", [LLAMA, GPT2, MIXTRAL, GPT_OSS],
                         ids=["llama", "gpt2", "mixtral", "gpt_oss"])
def test_hooks_order_groups_as_torch_export_does(config) -> None:
    """The profiler dropped torch.export as a second tracer (graph/trace.py): its module stack
    gives the same embedding, blocks and head as the hooks of the profiling run."""
    import torch

    from autopar.graph.inputs import make_batch
    from autopar.graph.structure import find_blocks, group_outside

    captured = {}
    original = autopar.graph.profiler.group_outside

    def spy(container, blocks, order):
        captured["args"] = (container, tuple(blocks), tuple(order))
        return original(container, blocks, order)

    model = from_hf_config(config)
    mp = pytest.MonkeyPatch()
    mp.setattr(autopar.graph.profiler, "group_outside", spy)
    try:
        prof = autopar.profile(model, seq_len=16)
    finally:
        mp.undo()
    container, blocks, hooks_order = captured["args"]
    assert prof.trace_method == "modules" and find_blocks(model)[1] == blocks
    batch = make_batch(model, 1, 16, None, torch.bfloat16)
    program = torch.export.export(model, batch.args, kwargs=batch.kwargs, strict=False)
    export_order = []
    for node in program.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            if path and path not in export_order:
                export_order.append(path)
    assert group_outside(container, blocks, export_order) == group_outside(
        container, blocks, hooks_order)
