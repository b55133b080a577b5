"""What a framework's own kernels keep of a traced model: composite norms and index_add combines.

A Hugging Face model is traced as written: its ``*RMSNorm`` keeps an fp32 copy of its input and
the normalised product, and its experts combine with ``index_add``, which keeps its source. A
framework that runs its own fused norm kernels and a scatter combine (Megatron-LM) keeps
neither; autopar's runtime runs the traced modules and keeps both (graph/recorder.py,
cost_model/layer_terms.py ``kept_less_of``).
"""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.config import ParallelConfig
from autopar.cost_model.frameworks import FRAMEWORKS, get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table

H, S = 64, 32
_HF = {"hidden_size": H, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}


def _block(profile):
    return next(x for x in profile.layers if x.kind == "block")


def test_composite_norms_are_counted_beyond_a_fused_kernel():
    """Per token and norm, Hugging Face's RMSNorm keeps its input in fp32 (4 h bytes), 1/rms
    (4) and the normalised bf16 product (2 h): 4 h - 4 bytes beyond a fused kernel's bf16 input
    and two fp32 statistics; replicated (the residual stream's width). The zoo's norms run
    ``F.rms_norm`` / ``F.layer_norm`` as one kernel: nothing beyond."""
    hf = _block(autopar.profile(autopar.models.from_hf_config({"model_type": "llama", **_HF}),
                                seq_len=S))
    assert hf.norm_saved_bytes == (S * 2 * (4 * H - 4),) * 2  # two norms a block
    assert hf.norm_saved_bytes[0] < hf.saved_bytes["selective"]
    for kind in ("llama", "gpt"):
        zoo = _block(autopar.profile(autopar.models.build(
            kind, layers=2, hidden=H, heads=4, vocab=256, seq_len=S)))
        assert zoo.norm_saved_bytes == (0, 0)
        assert zoo.combine_saved_bytes == (0, 0)  # dense: no combine


@pytest.mark.parametrize("source", ["hf", "zoo"])
def test_index_add_combine_copy_is_counted(source):
    """index_add keeps its source, the k weighted expert outputs of every token (k h bf16
    elements a token), for a backward that reads only its shape."""
    if source == "hf":
        model = autopar.models.from_hf_config({"model_type": "mixtral", "num_local_experts": 4,
                                               "num_experts_per_tok": 2, **_HF})
    else:
        model = autopar.models.build("llama", layers=2, hidden=H, heads=4, kv_heads=2,
                                     vocab=256, seq_len=S, experts=4, top_k=2)
    block = _block(autopar.profile(model, seq_len=S))
    assert block.combine_saved_bytes == (S * 2 * H * 2,) * 2


def test_framework_kernels_keep_less_memory_only():
    """Megatron-LM (fused norms, scatter combine) keeps the norm and combine bytes less per
    micro-batch (fragmentation included) without recompute and under selective; full recompute
    keeps the block input only; times are unchanged (memory only). autopar's runtime runs the
    traced modules: it keeps them."""
    model = autopar.models.from_hf_config({"model_type": "mixtral", "num_local_experts": 4,
                                           "num_experts_per_tok": 2, **_HF})
    profile = autopar.profile(model, seq_len=S)
    block = _block(profile)
    index = profile.layers.index(block)
    lean = get_framework("megatron-lm")
    assert lean.fused_norms and lean.scatter_combine
    plain = dataclasses.replace(lean, fused_norms=False, scatter_combine=False)
    cluster = Cluster.preset("h100", nodes=1)
    cfg = ParallelConfig(dp=2, pp=2, global_batch=16, micro_batch=2)
    a, b = (build_cost_table(profile, cluster, cfg, fw).layers[index] for fw in (lean, plain))
    dropped = (block.norm_saved_bytes[0] + block.combine_saved_bytes[0]) * cfg.micro_batch
    for mode in (0, 1):
        assert b.act_bytes[mode] - a.act_bytes[mode] == pytest.approx(
            dropped * (1 + lean.fragmentation_fraction))
    assert a.act_bytes[2] == b.act_bytes[2]
    assert (a.compute_s, a.recompute_s) == (b.compute_s, b.recompute_s)
    mine = get_framework("autopar")
    assert not (mine.fused_norms or mine.scatter_combine)
    for name in FRAMEWORKS:  # each choice has its source
        fw = get_framework(name)
        assert fw.sources["fused_norms"].startswith("sourced:")
        assert fw.sources["scatter_combine"].startswith("sourced:")
