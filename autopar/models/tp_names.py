"""Tensor-parallel styles of linears by the last component of their name, listed once.

Column-wise: a block's input projections (attention q, k, v; MLP up / gate); row-wise: its
output projections (attention out; MLP down), Megatron-LM's pairing (Shoeybi et al. 2019,
section 3). The zoo's names (``ZOO_COLWISE`` / ``ZOO_ROWWISE``, autopar/models/transformer.py)
are a subset of the names recognised in any model (``COLWISE_NAMES`` / ``ROWWISE_NAMES``:
the zoo's, HF Llama / OPT / GPT-2 / GPT-J / GPT-NeoX / BERT-style ones).
"""

from __future__ import annotations

__all__ = ["COLWISE_NAMES", "FUSED_NAMES", "FUSED_QKV_NAMES", "ROWWISE_NAMES", "ZOO_COLWISE",
           "ZOO_ROWWISE"]

ZOO_COLWISE = frozenset({"wq", "wk", "wv", "w1", "w3"})
ZOO_ROWWISE = frozenset({"wo", "w2"})
COLWISE_NAMES = ZOO_COLWISE | {
    "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value", "fc1",
    "fc_in", "dense_h_to_4h", "c_fc",
}
ROWWISE_NAMES = ZOO_ROWWISE | {
    "o_proj", "down_proj", "out_proj", "fc2", "fc_out", "dense_4h_to_h", "c_proj",
}
# One matrix computing q, k and v of equal widths (GPT-2, Phi-3, MPT, GPT-NeoX / Falcon):
# column-parallel, split per q / k / v (graph/tp.py).
FUSED_QKV_NAMES = frozenset({"c_attn", "qkv_proj", "Wqkv", "query_key_value"})
# Every fused projection a plain column split would mix up: the equal-width qkv ones, a qkv of
# unequal widths (grouped-query "qkv") and the MLP's gate + up in one matrix (Phi-3).
FUSED_NAMES = FUSED_QKV_NAMES | {"qkv", "gate_up_proj"}
