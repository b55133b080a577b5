"""Hugging Face decoders and a nanoGPT-shaped model file under every split equal one process.

Tiny HF Llama (GQA), Qwen2 (q/k/v biases) and GPT-2 (``Conv1D`` linears, fused ``c_attn``) built
from a config object with transformers (no download), Qwen3 and Gemma 3 (per-head q/k norms) and
Gemma 2 (sandwich norms) and OLMo 2 (q and k norms over all heads' features) under tp with and
without sequence parallelism, Llama, Qwen3 and
DeepSeek-V3, Mistral, Gemma 3, gpt-oss (attention sinks) and Gemma 2 (capped logits) under
context parallelism (alone, with FSDP, with tp + SP), the mixture-of-experts
gpt-oss, Llama 4 and
DeepSeek-V3 (FSDP and PP 1F1B), Mixtral, Qwen3-MoE and DeepSeek-V3 under expert parallelism (alone,
with FSDP over the ranks holding the same experts, and under pp), Mixtral, Qwen3-MoE and Llama 4
under tp + SP (the MoE module gathering the sequence), and
``tests/fixtures/models/tiny_nanogpt_split.py`` (blocks at ``transformer.h``, fused ``c_attn``).
Each case builds the model twice from one seed, runs the one-process step on the global batch and
the split under ``apply_plan`` (the layout the graph finds, ``default_tp_layout``, which is what
``autopar plan`` writes), and compares the first step's gradients of every parameter (rtol 1e-5,
DTensors gathered) and the losses of two AdamW steps. One launch of 2 processes runs DP, FSDP, TP,
TP+SP (with selective recomputation), PP 1F1B (with full recomputation) and interleaved 1F1B; one
of 4 processes a 2x2 mix per model.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import case_errors

NANOGPT = str(Path(__file__).resolve().parents[1] / "fixtures" / "models"
              / "tiny_nanogpt_split.py")
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 64, "max_position_embeddings": 16, "tie_word_embeddings": False,
    },
    "qwen2": {
        "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 64, "max_position_embeddings": 16, "tie_word_embeddings": False,
    },
    "gpt2": {
        "model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64,
        "n_positions": 16, "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False,
    },
    # Mixture-of-experts families whose experts transformers stores [E, in, out] (gpt-oss, with
    # biases; Llama 4, called on rows repeated per expert) or whose first layers are dense
    # (DeepSeek-V3): decoder layers of one class with different insides.
    "gpt_oss": {
        "model_type": "gpt_oss", "hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 64,
        "max_position_embeddings": 16, "tie_word_embeddings": False, "sliding_window": 4,
    },
    "llama4": {
        "model_type": "llama4_text", "hidden_size": 32, "intermediate_size": 64,
        "intermediate_size_mlp": 64, "head_dim": 8, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 1, "vocab_size": 64, "max_position_embeddings": 16,
        "tie_word_embeddings": False,
    },
    # GLM-4: a fused gate_up_proj no name marks, so its MLP stays whole under tp (graph/tp.py)
    # and only the attention is split.
    "glm4": {
        "model_type": "glm4", "hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 64, "max_position_embeddings": 16, "tie_word_embeddings": False,
        "pad_token_id": None,
    },
    # Per-head q_norm / k_norm inside the attention (graph.tp.per_head_norms): split with their
    # heads, their weight gradients summed over tp. Gemma 3 applies them after the transpose.
    "qwen3": {
        "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 64, "max_position_embeddings": 16, "tie_word_embeddings": False,
    },
    # OLMo 2 norms q and k over all heads' features (q_norm of width heads * head_dim).
    "olmo2": {
        "model_type": "olmo2", "hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 64, "max_position_embeddings": 16, "tie_word_embeddings": False,
    },
    # Gemma 2 and 3 norm the attention's and the MLP's outputs before the residual add
    # ("sandwich" norms): under sequence parallelism their output is the local sequence shard.
    # Gemma 2 caps its attention logits (tanh at 0.5 here, so the cap bites on tiny weights).
    "gemma2": {
        "model_type": "gemma2", "hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 64, "max_position_embeddings": 16, "tie_word_embeddings": False,
        "sliding_window": 4, "attn_logit_softcapping": 0.5,
    },
    # Mistral: a sliding window of 4 of the 8 tokens (under cp, masked by global positions).
    "mistral": {
        "model_type": "mistral", "hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 64, "max_position_embeddings": 16, "tie_word_embeddings": False,
        "sliding_window": 4,
    },
    "gemma3_text": {
        "model_type": "gemma3_text", "hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 64, "max_position_embeddings": 16, "tie_word_embeddings": False,
        "sliding_window": 4,
    },
    # Stacked [E, out, in] experts: autopar's runtime shards them over ep (graph.moe).
    "mixtral": {
        "model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 64,
        "max_position_embeddings": 16, "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 32, "head_dim": 8, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
        "num_experts_per_tok": 2, "vocab_size": 64, "max_position_embeddings": 16,
        "tie_word_embeddings": False,
    },
    # DBRX: each expert f_e rows of three [E f_e, h] matrices (no router jitter: deterministic).
    "dbrx": {
        "model_type": "dbrx", "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 16,
        "vocab_size": 64, "attn_config": {"clip_qkv": 8, "kv_n_heads": 2, "rope_theta": 10000},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2,
                       "moe_jitter_eps": None},
        "tie_word_embeddings": False,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3", "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
        "v_head_dim": 8, "vocab_size": 64, "max_position_embeddings": 16,
        "tie_word_embeddings": False,
    },
}
MODELS = ("llama", "qwen2", "gpt2", "nanogpt")
MOE_MODELS = ("gpt_oss", "llama4", "deepseek_v3")
NUM_BLOCKS = 2
VOCAB = 64
SEQ_LEN = 8
GLOBAL_BATCH = 8
STEPS = 2
LR = 1e-2


def build(name: str) -> Any:
    """The model ``name`` on CPU with seed-0 weights (the same on every process)."""
    if name == "nanogpt":
        from autopar.models import load_model_file

        return load_model_file(NANOGPT).instantiate("cpu", seed=0)
    from autopar.models.hf import from_hf_config

    return from_hf_config(HF_CONFIGS[name], device="cpu", seed=0)


def run_case(name: str, cfg_kwargs: dict[str, Any]) -> dict[str, Any]:
    """One split of one model against the one-process step on this rank."""
    import torch
    from torch.testing import assert_close

    from autopar.config import ParallelConfig
    from autopar.runtime import apply_plan, build_mesh
    from autopar.runtime.apply import default_loss
    from autopar.runtime.step import gathered_grads, local_batch, one_process_reference, train_step

    cfg = ParallelConfig(global_batch=GLOBAL_BATCH, dtype="fp32", **cfg_kwargs)
    from tests.distributed.test_runtime_equivalence import make_plan

    plan = make_plan(cfg, NUM_BLOCKS, block_name="block{}")
    reference = build(name)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    pm = apply_plan(build(name), plan, build_mesh(plan, "cpu"))
    if cfg.tp > 1 and name in MODELS:
        _check_sharded(pm, cfg.tp)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1234)
    losses, ref_losses, grads = [], [], {}
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
        labels = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
        ref_losses.append(one_process_reference(reference, tokens, labels, loss_fn=default_loss))
        losses.append(train_step(pm, local_batch(pm, tokens), local_batch(pm, labels), None))
        if step == 0:
            grads = gathered_grads(pm)
            for fqn, grad in grads.items():
                assert_close(grad, _expected(reference, fqn, cfg, pm), rtol=1e-5, atol=1e-7,
                             msg=lambda m, f=fqn: f"{f}: {m}")
        opt.step()
        ref_opt.step()
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-4 * abs(want), f"losses {losses} != reference {ref_losses}"
    return {"fqns": sorted(grads), "losses": losses}


def _expected(reference: Any, fqn: str, cfg: Any, pm: Any) -> Any:
    """The one-process gradient of ``fqn``; under ep, of this rank's E / ep experts."""
    from autopar.graph.moe import expert_modules

    full = reference.get_parameter(fqn).grad
    if cfg.ep == 1 or not any(fqn.startswith(f"{m}.") for m, _ in expert_modules(reference)):
        return full
    local = full.shape[0] // cfg.ep
    place = pm.mesh["dp"].get_local_rank() * cfg.cp + pm.mesh["cp"].get_local_rank()
    lo = place % cfg.ep * local
    return full[lo:lo + local]


def _check_sharded(pm: Any, tp: int) -> None:
    """Real tensor parallelism: every matrix in the blocks is a DTensor holding 1/tp of it."""
    from torch.distributed.tensor import DTensor

    matrices = [
        (fqn, p) for part in pm.model_parts for fqn, p in part.named_parameters()
        if p.dim() == 2 and (".layers." in fqn or ".h." in fqn)
    ]
    assert matrices, "no block matrices on this rank"
    for fqn, p in matrices:
        assert isinstance(p, DTensor) and p.to_local().numel() * tp <= p.numel(), fqn


def run_cases(rank: int, world_size: int, cases: list[tuple[str, str, dict]]) -> dict:
    """Every case on this rank; a failing case is reported and the others still run."""
    results: dict[str, Any] = {}
    for label, name, cfg_kwargs in cases:
        try:
            results[label] = run_case(name, cfg_kwargs)
        except Exception:
            results[label] = {"error": traceback.format_exc(limit=8)}
    return results


def check(results: list[dict], cases: list[tuple[str, str, dict]]) -> None:
    """Fail with every failing case; the ranks together checked every parameter's gradient."""
    errors = []
    for label, name, _cfg in cases:
        every = {fqn for fqn, _ in build(name).named_parameters()}
        errors += case_errors(label, [r[label] for r in results], every)
    assert not errors, "\n".join(errors)


SPLITS_2: dict[str, dict[str, Any]] = {
    "ddp2": {"dp": 2, "micro_batch": 2},
    "fsdp2": {"dp": 2, "zero": 3, "micro_batch": 2},
    "tp2": {"tp": 2, "micro_batch": 4},
    "tp2-sp-selective": {"tp": 2, "sequence_parallel": True, "micro_batch": 4,
                         "recompute": "selective"},
    "pp2-1f1b-full": {"pp": 2, "schedule": "1f1b", "micro_batch": 2, "recompute": "full"},
    "pp2-interleaved": {
        "pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batch": 2,
    },
}
# One 2x2 mix per model: (label, model, config). FSDP under tp goes to the models without a fused
# q/k/v (with one it is refused, see test_run_any_model.py).
MIXES_4: list[tuple[str, str, dict[str, Any]]] = [
    ("llama-dp2xtp2-fsdp", "llama", {"dp": 2, "tp": 2, "zero": 3, "micro_batch": 2}),
    ("qwen2-pp2xdp2", "qwen2", {"pp": 2, "dp": 2, "zero": 1, "schedule": "1f1b",
                                "micro_batch": 1}),
    ("gpt2-pp2xtp2-sp-interleaved", "gpt2", {"pp": 2, "tp": 2, "sequence_parallel": True,
                                             "schedule": "interleaved-1f1b", "virtual_stages": 2,
                                             "micro_batch": 2}),
    ("nanogpt-dp2xtp2-sp", "nanogpt", {"dp": 2, "tp": 2, "zero": 0, "micro_batch": 2,
                                       "sequence_parallel": True}),
    ("llama-dp2xcp2-fsdp", "llama", {"dp": 2, "cp": 2, "zero": 3, "micro_batch": 2}),
    ("qwen2-cp2xtp2-sp", "qwen2", {"cp": 2, "tp": 2, "sequence_parallel": True,
                                   "micro_batch": 4}),
    ("llama-pp2xcp2", "llama", {"pp": 2, "cp": 2, "schedule": "1f1b", "micro_batch": 2}),
    # Per-head norms under tp with FSDP2 over dp (their weights 2-D DTensors) and under pp.
    ("qwen3-dp2xtp2-fsdp", "qwen3", {"dp": 2, "tp": 2, "zero": 3, "micro_batch": 2}),
    ("gemma3-pp2xtp2-sp", "gemma3_text", {"pp": 2, "tp": 2, "sequence_parallel": True,
                                          "schedule": "1f1b", "micro_batch": 2}),
    # ep 2 of dp 4 (FSDP2 over the 2 ranks holding each half of the experts) and under pp.
    ("qwen3_moe-dp4-ep2-zero1", "qwen3_moe", {"dp": 4, "ep": 2, "zero": 1, "micro_batch": 2}),
    ("dbrx-dp4-ep2-zero3", "dbrx", {"dp": 4, "ep": 2, "zero": 3, "micro_batch": 2}),
    ("llama4-dp2xtp2-ep2-sp", "llama4", {"dp": 2, "tp": 2, "ep": 2, "zero": 3,
                                         "sequence_parallel": True, "micro_batch": 2}),
    ("mixtral-pp2xdp2-ep2", "mixtral", {"pp": 2, "dp": 2, "ep": 2, "schedule": "1f1b",
                                        "micro_batch": 1}),
    # ep with tp: both tp ranks of a dp rank hold the same experts and route the same tokens.
    ("mixtral-dp2xtp2-ep2-zero1", "mixtral", {"dp": 2, "tp": 2, "ep": 2, "zero": 1,
                                              "micro_batch": 2}),
    ("gpt_oss-dp2xtp2-fsdp", "gpt_oss", {"dp": 2, "tp": 2, "zero": 3, "micro_batch": 2}),
    # ... and under sequence parallelism: the MoE gathers the sequence, then dispatches it.
    ("mixtral-dp2xtp2-ep2-sp", "mixtral", {"dp": 2, "tp": 2, "ep": 2, "zero": 3,
                                           "sequence_parallel": True, "micro_batch": 2}),
]


def _cases(splits: dict[str, dict[str, Any]],
           models: tuple[str, ...] = MODELS) -> list[tuple[str, str, dict]]:
    return [(f"{name}-{split}", name, cfg) for name in models for split, cfg in splits.items()]


# The mixture-of-experts families run their experts as transformers writes them (dp and pp;
# tp splits linears only and is refused where a norm sits inside the attention: DeepSeek-V3).
MOE_SPLITS_2 = {key: SPLITS_2[key] for key in ("fsdp2", "pp2-1f1b-full")}
# Context parallelism of decoders calling transformers' attention interface with rotary positions
# (graph.cp): alone, with dp and with tp + SP (4 processes); gpt-oss (sinks) and Gemma 2 (capped
# logits) through their family's eager attention.
CP_CASES_2 = [(f"{name}-cp2", name, {"cp": 2, "micro_batch": 4})
              for name in ("llama", "qwen3", "deepseek_v3", "mistral", "gemma3_text", "gpt_oss",
                           "gemma2")]
# Tensor parallelism of blocks with per-head norms, sandwich norms or norms over all heads'
# features (OLMo 2: tp_styles.WidthNorm), with and without sequence parallelism.
HEAD_NORM_MODELS = ("qwen3", "gemma2", "gemma3_text", "olmo2")
HEAD_NORM_SPLITS_2 = {key: SPLITS_2[key] for key in ("tp2", "tp2-sp-selective")}
# Expert parallelism of the experts families: each rank runs 2 of the 4 experts
# on the tokens the all-to-all brings it (zero 0: the experts' gradients summed by hooks).
EP_CASES_2 = [
    ("mixtral-ep2", "mixtral", {"dp": 2, "ep": 2, "micro_batch": 2}),
    ("deepseek_v3-ep2-zero3-full", "deepseek_v3", {"dp": 2, "ep": 2, "zero": 3,
                                                   "micro_batch": 2, "recompute": "full"}),
    # gpt-oss: [E, in, out] experts with biases and its own clamped, interleaved SwiGLU gate.
    ("gpt_oss-ep2-zero1", "gpt_oss", {"dp": 2, "ep": 2, "zero": 1, "micro_batch": 2}),
    # DBRX: each expert f_e rows of its [E f_e, h] matrices, sliced over ep as the rows.
    ("dbrx-ep2", "dbrx", {"dp": 2, "ep": 2, "micro_batch": 2}),
    ("dbrx-cp2-ep2", "dbrx", {"cp": 2, "ep": 2, "micro_batch": 4}),  # ep over the cp ranks
    # Llama 4: experts called on every expert's block of routed rows; the picked rows exchanged.
    ("llama4-ep2-zero3-full", "llama4", {"dp": 2, "ep": 2, "zero": 3, "micro_batch": 2,
                                         "recompute": "full"}),
]


# Tensor parallelism of MoE families (experts whole on every tp rank): under sequence
# parallelism the MoE module gathers the whole sequence (Llama 4's flattened [b s, h] output
# cut as [b, s, h]); Llama 4 adds to its shared expert's output in place (a copy is handed out).
MOE_TP_CASES_2 = [
    ("mixtral-tp2-sp", "mixtral", {"tp": 2, "sequence_parallel": True, "micro_batch": 2}),
    # gpt-oss: its attention sinks (one per head) split with the heads, read in the family's
    # eager attention, also when a selective recompute re-runs it in the backward.
    ("gpt_oss-tp2", "gpt_oss", SPLITS_2["tp2"]),
    ("gpt_oss-tp2-sp-selective", "gpt_oss", SPLITS_2["tp2-sp-selective"]),
    ("qwen3_moe-tp2-sp-full", "qwen3_moe", {"tp": 2, "sequence_parallel": True,
                                             "micro_batch": 2, "recompute": "full"}),
    ("llama4-tp2", "llama4", {"tp": 2, "micro_batch": 2}),
    ("llama4-tp2-sp", "llama4", {"tp": 2, "sequence_parallel": True, "micro_batch": 2}),
]


# Pipeline stages of a model that picks each layer's mask by the layer's index (Gemma 2: sliding
# and full layers alternate) and caps its logits after the head: stage 1's block keeps its own
# index (nested_stage._SkippedBlock), stage 0 hands on what reaches the head, not capped logits.
# The split-backward schedules detach a stage's output in place: Hugging Face's head slices the
# hidden states (a view) before the head's stand-in hands them on.
PP_CASES_2 = [("gemma2-pp2-1f1b-full", "gemma2", SPLITS_2["pp2-1f1b-full"]),
              ("llama-pp2-zbv", "llama", {"pp": 2, "schedule": "zbv-zero-bubble",
                                          "virtual_stages": 2, "micro_batch": 2}),
              ("gpt2-pp2-interleaved-zb", "gpt2", {"pp": 2, "schedule": "interleaved-zero-bubble",
                                                   "virtual_stages": 2, "micro_batch": 2})]


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_hf_and_nanogpt_two_process_splits_equal_one_process(run_distributed: Any) -> None:
    pytest.importorskip("transformers")
    cases = _cases(SPLITS_2) + _cases(MOE_SPLITS_2, MOE_MODELS) + EP_CASES_2 + [
        ("glm4-tp2", "glm4", SPLITS_2["tp2"])] + _cases(HEAD_NORM_SPLITS_2, HEAD_NORM_MODELS) + (
        CP_CASES_2) + PP_CASES_2 + MOE_TP_CASES_2
    check(run_distributed(run_cases, 2, cases, timeout_s=180), cases)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_hf_and_nanogpt_four_process_mixes_equal_one_process(run_distributed: Any) -> None:
    pytest.importorskip("transformers")
    cases = MIXES_4
    check(run_distributed(run_cases, 4, cases, timeout_s=180), cases)
