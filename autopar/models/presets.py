"""Named zoo models with the shapes their papers publish.

Sources:
- GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (n_layers, d_model,
  n_heads); context 2048. Two rows of that table do not factor: 1.3B lists 24 heads of 128 for
  d_model 2048, and 13B lists d_model 5140 with 40 heads of 128. autopar uses 16 heads (d_head 128)
  for 1.3B and d_model 5120 for 13B, the shapes the common reproductions train (head count does not
  change the parameter count). Vocabulary: GPT-3 uses GPT-2's BPE (50257 tokens); autopar uses the
  Megatron-LM padding of it, 51200 (Narayanan et al. SC'21, Table 1), because planning needs a
  vocabulary that tensor parallelism can shard (51200 = 2^11 * 25 divides by every tp up to 8;
  50257 is odd). Pass ``vocab=50257`` to get the unpadded model. Embeddings tied (as in GPT-2).
- GPT-2: Radford et al. 2019, Table 2 (12/24/36/48 layers, d_model 768/1024/1280/1600); heads
  12/16/20/25 (head dim 64) from the released configs; context 1024, vocabulary 50257, tied.
- Llama 2: Touvron et al. 2023, Table 1 and the released params.json (context 4096, vocabulary
  32000, SwiGLU widths 11008 / 13824 / 28672, GQA with 8 kv heads for 70B only); untied head.
- Llama 3 / 3.1: Llama Team 2024, "The Llama 3 Herd of Models", Table 3 (layers, width, FFN width,
  heads, 8 kv heads, vocabulary 128256, RoPE base 500000); context 8192 (the pre-training length).
- Mixtral 8x7B / 8x22B: the released configs (huggingface.co/mistralai/Mixtral-8x7B-v0.1 and
  Mixtral-8x22B-v0.1, config.json: hidden_size, intermediate_size, num_hidden_layers,
  num_attention_heads, num_key_value_heads, num_local_experts 8, num_experts_per_tok 2,
  vocab_size 32000, rope_theta 1e6) and Jiang et al. 2024 ("Mixtral of Experts", Table 1).
  Context 4096 for planning (the configs allow 32768 / 65536; pass ``seq_len=`` for more).
  Router imbalance ``MIXTRAL_ROUTER_IMBALANCE`` (the busiest expert-parallel rank's routed rows
  over the average, dropless): fitted by benchmarks/router_imbalance.py, through the cost model,
  to Megatron-MoE-ModelZoo's Mixtral 8x22B run on 128 H100 (EP 8, released checkpoint, the same
  run 445 TFLOP/s dropless and 465 force-balanced: benchmarks/data/moe_router_balance.json).
  8x7B has no pair of its own; it carries its family's value (the same router design: 8
  experts, top-2, an auxiliary balancing loss; both released by Mistral AI).
- DeepSeek-V3-shaped: huggingface.co/deepseek-ai/DeepSeek-V3 config.json (hidden_size 7168, 61
  layers, 128 heads, n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1,
  moe_intermediate_size 2048, vocab_size 129280) and DeepSeek-AI 2024 (arXiv 2412.19437, section
  4.2: 4K pre-training sequence length). "Shaped": the zoo's llama block has multi-head attention
  where V3 has multi-head latent attention, and every block is MoE where V3's first three are
  dense (first_k_dense_replace 3); parameters come to ~0.70T against V3's 671B.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["MIXTRAL_ROUTER_IMBALANCE", "PRESETS", "preset_shape"]

# fitted: benchmarks/router_imbalance.py (the module docstring's Mixtral pair): 1.063.
MIXTRAL_ROUTER_IMBALANCE = 1.06


def _gpt3(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    return dict(
        kind="gpt", layers=layers, hidden=hidden, heads=heads, vocab=51200, seq_len=2048,
        tie_embeddings=True,
    )  # fmt: skip


def _gpt2(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    return dict(
        kind="gpt", layers=layers, hidden=hidden, heads=heads, vocab=50257, seq_len=1024,
        tie_embeddings=True,
    )  # fmt: skip


def _llama2(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> dict[str, Any]:
    return dict(
        kind="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        ffn_hidden=ffn, vocab=32000, seq_len=4096, rope_theta=10000.0,
    )  # fmt: skip


def _llama3(layers: int, hidden: int, heads: int, ffn: int) -> dict[str, Any]:
    return dict(
        kind="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=8,
        ffn_hidden=ffn, vocab=128256, seq_len=8192, rope_theta=500000.0,
    )  # fmt: skip


def _moe(layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, **moe: Any):
    return dict(
        kind="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        vocab=vocab, seq_len=4096, **moe,
    )  # fmt: skip


_GPT3 = "GPT-3 (Brown et al. 2020, Table 2.1)"
_GPT2 = "GPT-2 (Radford et al. 2019)"
_LLAMA2 = "Llama 2 (Touvron et al. 2023)"
_LLAMA3 = "Llama 3 (Llama Team 2024, Table 3)"
_MIXTRAL = "Mixtral (mistralai config.json; Jiang et al. 2024)"
_DSV3 = "DeepSeek-V3-shaped (deepseek-ai/DeepSeek-V3 config.json; MHA, all blocks MoE)"

# name -> (shape keyword arguments for build, source)
PRESETS: Mapping[str, tuple[Mapping[str, Any], str]] = MappingProxyType(
    {
        "gpt3-125m": (_gpt3(12, 768, 12), _GPT3),
        "gpt3-350m": (_gpt3(24, 1024, 16), _GPT3),
        "gpt3-760m": (_gpt3(24, 1536, 16), _GPT3),
        "gpt3-1.3b": (_gpt3(24, 2048, 16), _GPT3),
        "gpt3-2.7b": (_gpt3(32, 2560, 32), _GPT3),
        "gpt3-6.7b": (_gpt3(32, 4096, 32), _GPT3),
        "gpt3-13b": (_gpt3(40, 5120, 40), _GPT3),
        "gpt3-175b": (_gpt3(96, 12288, 96), _GPT3),
        "gpt2": (_gpt2(12, 768, 12), _GPT2),
        "gpt2-medium": (_gpt2(24, 1024, 16), _GPT2),
        "gpt2-large": (_gpt2(36, 1280, 20), _GPT2),
        "gpt2-xl": (_gpt2(48, 1600, 25), _GPT2),
        "llama2-7b": (_llama2(32, 4096, 32, 32, 11008), _LLAMA2),
        "llama2-13b": (_llama2(40, 5120, 40, 40, 13824), _LLAMA2),
        "llama2-70b": (_llama2(80, 8192, 64, 8, 28672), _LLAMA2),
        "llama3-8b": (_llama3(32, 4096, 32, 14336), _LLAMA3),
        "llama3-70b": (_llama3(80, 8192, 64, 28672), _LLAMA3),
        "llama3-405b": (_llama3(126, 16384, 128, 53248), _LLAMA3),
        "mixtral-8x7b": (_moe(32, 4096, 32, 8, 32000, ffn_hidden=14336, experts=8, top_k=2,
                              rope_theta=1e6, router_imbalance=MIXTRAL_ROUTER_IMBALANCE),
                         _MIXTRAL),
        "mixtral-8x22b": (_moe(56, 6144, 48, 8, 32000, ffn_hidden=16384, experts=8, top_k=2,
                               rope_theta=1e6, router_imbalance=MIXTRAL_ROUTER_IMBALANCE),
                          _MIXTRAL),
        "deepseek-v3": (_moe(61, 7168, 128, 128, 129280, ffn_hidden=18432, experts=256,
                             top_k=8, shared_experts=1, expert_hidden=2048), _DSV3),
    }
)


def preset_shape(name: str) -> dict[str, Any]:
    """A copy of preset ``name``'s keyword arguments (including ``kind``); KeyError if unknown."""
    return dict(PRESETS[name][0])
