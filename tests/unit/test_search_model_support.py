"""Plans autopar's runtime can run: it shards over cp the attention it runs (the zoo's, a Hugging
Face decoder's through transformers' attention interface with rotary positions), and over ep the
experts it can run one at a time (the zoo's, and Hugging Face's stacked [E, out, in] experts),
so other models are planned for it without them (and for a framework that runs its own
implementation of the architecture, with them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.search import SearchOptions
from autopar.search.planner import _candidates

SEQ = 16_384
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"


@pytest.fixture(scope="module")
def moe_profile():
    model = autopar.models.build("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256,
                                 seq_len=SEQ, experts=4, top_k=2)
    return autopar.profile(model, seq_len=SEQ)


NO_CP = "it attends within a sliding window"


def test_profiles_say_why_not_cp_and_keep_their_json(moe_profile):
    assert not moe_profile.cp_blocker and "cp_blocker" not in moe_profile.to_dict()
    hf = dataclasses.replace(moe_profile, cp_blocker=NO_CP)
    assert hf.to_dict()["cp_blocker"] == NO_CP
    assert type(hf).from_dict(hf.to_dict()) == hf
    assert type(hf).from_dict(moe_profile.to_dict()) == moe_profile
    legacy = {**moe_profile.to_dict(), "zoo_modules": False}  # written before cp_blocker
    assert type(hf).from_dict(legacy).cp_blocker


@pytest.mark.parametrize(("model_type", "why"), [
    ("llama", ""), ("mistral", ""), ("gpt2", "has no rotary embeddings"),
    # Sinks (gpt-oss) and capped logits (Gemma 2) run the family's own eager attention.
    ("gpt_oss", ""), ("gemma2", ""),
])
def test_hf_config_profiles_say_why_not_cp(model_type, why):
    pytest.importorskip("transformers")
    blocker = autopar.profile(_tiny_hf(model_type), seq_len=16).cp_blocker
    assert (why in blocker) if why else blocker == ""


def _tiny_hf(model_type: str):
    from autopar.models.hf import from_hf_config

    return from_hf_config({"model_type": model_type, "hidden_size": 32, "n_embd": 32,
                           "intermediate_size": 64, "num_hidden_layers": 1, "n_layer": 1,
                           "num_attention_heads": 4, "n_head": 4, "num_key_value_heads": 2,
                           "head_dim": 8, "vocab_size": 64, "max_position_embeddings": 16,
                           "n_positions": 16, "num_local_experts": 4,
                           "num_experts_per_tok": 2})


@pytest.mark.parametrize(("model_type", "why"), [
    ("gpt_oss", "keeps attention sinks"), ("gemma2", "keeps capped attention logits")])
def test_sinks_and_capped_logits_need_the_family_eager_function(monkeypatch, model_type, why):
    pytest.importorskip("transformers")
    import importlib

    from autopar.graph.cp import cp_blocker

    model = _tiny_hf(model_type)
    assert cp_blocker(model) == ""
    family = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    monkeypatch.delattr(family, "eager_attention_forward")
    blocker = cp_blocker(model)
    assert why in blocker and "no eager attention function" in blocker


def _dims(profile, framework: str) -> set[tuple[int, int]]:
    cluster = Cluster.preset("h100", nodes=2)
    options = SearchOptions(framework=framework, max_virtual_stages=2)
    return {(c.cp, c.ep) for c in _candidates(profile, cluster, 16, options)}


def _ep_blocked(profile, why="its experts have biases"):
    """The profile as if its experts were of a layout the runtime cannot run."""
    layers = tuple(dataclasses.replace(x, moe=dataclasses.replace(x.moe, ep_blocker=why))
                   if x.moe else x for x in profile.layers)
    return dataclasses.replace(profile, layers=layers)


def test_search_offers_cp_and_ep_only_where_the_runtime_runs_them(moe_profile):
    zoo = _dims(moe_profile, "autopar")
    assert any(cp > 1 for cp, _ in zoo) and any(ep > 1 for _, ep in zoo)
    other = dataclasses.replace(moe_profile, cp_blocker=NO_CP)  # its attention, zoo-like experts
    assert {cp for cp, _ in _dims(other, "autopar")} == {1}
    assert any(ep > 1 for _, ep in _dims(other, "autopar"))
    assert {ep for _, ep in _dims(_ep_blocked(moe_profile), "autopar")} == {1}
    for profile in (other, _ep_blocked(other)):
        titan = _dims(profile, "torchtitan")
        assert any(cp > 1 for cp, _ in titan) and any(ep > 1 for _, ep in titan)


def test_estimate_names_why(moe_profile):
    cluster = Cluster.preset("h100", nodes=1)
    for profile, dims, why in (
            (dataclasses.replace(moe_profile, cp_blocker=NO_CP), {"cp": 2, "dp": 4},
             r"context parallelism inside the attention it runs, and it attends within a "
             r"sliding window; use cp=1.*--framework torchtitan"),
            (_ep_blocked(moe_profile), {"ep": 2, "dp": 8, "zero": 1},
             r"one at a time .*, and its experts have biases; use ep=1.*--framework torchtitan")):
        cfg = ParallelConfig(global_batch=8, micro_batch=1, **dims)
        autopar.estimate(moe_profile, cluster, cfg)  # the zoo model runs it
        with pytest.raises(ValueError, match=why):
            autopar.estimate(profile, cluster, cfg)
        autopar.estimate(profile, cluster, cfg, framework="torchtitan")


def _blocked(profile):
    """The profile as if its blocks held a per-head weight beside their split linears."""
    layers = tuple(
        dataclasses.replace(x, tp=dataclasses.replace(x.tp, split_blocker="a per-head norm"))
        if x.kind == "block" else x for x in profile.layers)
    return dataclasses.replace(profile, layers=layers)


def test_search_offers_tp_only_where_the_traced_modules_split(moe_profile):
    dense = autopar.profile(autopar.models.build("llama", layers=2, hidden=64, heads=4,
                                                 kv_heads=2, vocab=256, seq_len=64), seq_len=64)
    cluster = Cluster.preset("h100", nodes=1)

    def tps(profile, framework):
        options = SearchOptions(framework=framework, max_virtual_stages=2)
        return {c.tp for c in _candidates(profile, cluster, 16, options)}

    assert tps(dense, "autopar") > {1}
    # Blocks whose linears the graph does not know by name: the runtime's layout splits nothing.
    unnamed = dataclasses.replace(dense, layers=tuple(
        dataclasses.replace(x, tp=dataclasses.replace(x.tp, colwise=(), rowwise=()))
        if x.kind == "block" else x for x in dense.layers))
    assert tps(unnamed, "autopar") == {1} and tps(unnamed, "torchtitan") > {1}
    with pytest.raises(ValueError, match=r"no linear in its blocks at .layers. has a tensor-"):
        autopar.estimate(unnamed, cluster, ParallelConfig(global_batch=8, tp=2, dp=4))
    blocked = _blocked(dense)
    assert tps(blocked, "autopar") == {1} and tps(blocked, "torchtitan") > {1}
    cfg = ParallelConfig(global_batch=8, micro_batch=1, tp=2, dp=4)
    with pytest.raises(ValueError, match="splits the model's own modules over tp, and a per-"):
        autopar.estimate(blocked, cluster, cfg)
    autopar.estimate(blocked, cluster, cfg, framework="megatron-lm")


def test_hf_norms_across_heads_are_recorded_in_the_profile():
    pytest.importorskip("transformers")
    from autopar.graph.types import ModelProfile
    from autopar.models.hf import from_hf_config

    def block(model_type: str):
        model = from_hf_config({"model_type": model_type, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 1,
                                "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 64, "max_position_embeddings": 16})
        return autopar.profile(model, seq_len=16)

    # OLMo 2 norms q over all heads' width (split with the features, its statistics
    # all-reduced); Qwen3 each head alone (it splits with its heads); neither blocks tp.
    profile = block("olmo2")
    assert profile.layers[1].tp.split_blocker == ""
    assert profile.layers[1].tp.width_norms == ("model.layers.0.self_attn.k_norm",
                                                "model.layers.0.self_attn.q_norm")
    assert block("qwen3").layers[1].tp.split_blocker == ""
    assert ModelProfile.from_dict(profile.to_dict()) == profile
    # Their statistics' all-reduces are charged (timed) under tp.
    cluster = Cluster.preset("h100", nodes=1)
    cfg = ParallelConfig(dp=4, tp=2, global_batch=16, sequence_parallel=True)
    plain = dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(x, tp=dataclasses.replace(x.tp, width_norms=()))
        for x in profile.layers))
    assert (autopar.estimate(profile, cluster, cfg).time_breakdown.tp_comm_s
            > autopar.estimate(plain, cluster, cfg).time_breakdown.tp_comm_s)
    zoo = autopar.profile(autopar.models.build("llama", layers=1, hidden=32, heads=4, vocab=64,
                                               seq_len=16), seq_len=16)
    assert all("split_blocker" not in x["tp"] for x in zoo.to_dict()["layers"])


def test_search_offers_pp_only_where_the_runtime_feeds_the_stages():
    """autopar's pipeline schedule splits token ids into micro-batches: a model trained on its
    own example_inputs batches (a loss_fn, or inputs that are not token ids) is planned for it
    at pp 1, and named in estimate's refusal; a framework with its own model code pipelines it."""
    from autopar.graph.inputs import pipeline_blocker

    model = autopar.models.build("llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=256,
                                 seq_len=64)

    def pair(batch_size: int):
        import torch

        idx = torch.randint(0, 256, (batch_size, 64))
        return idx, idx

    tokens = autopar.profile(model, seq_len=64)
    assert tokens.pp_blocker == "" and "pp_blocker" not in tokens.to_dict()
    assert pipeline_blocker(None, None) == ""
    assert pipeline_blocker(lambda b: pair(b)[0], None) == ""  # token ids alone
    own = autopar.profile(model, seq_len=64, example_inputs=lambda b: pair(b)[0],
                          loss_fn=lambda out, batch: out.float().mean())
    assert "own example_inputs batches" in own.pp_blocker
    assert type(own).from_dict(own.to_dict()) == own
    assert pipeline_blocker(pair, None) == own.pp_blocker  # a tuple: not token ids alone
    cluster = Cluster.preset("h100", nodes=1)

    def pps(profile, framework):
        options = SearchOptions(framework=framework, max_virtual_stages=2)
        return {c.pp for c in _candidates(profile, cluster, 16, options)}

    assert pps(tokens, "autopar") > {1}
    assert pps(own, "autopar") == {1} and pps(own, "torchtitan") > {1}
    cfg = ParallelConfig(global_batch=8, micro_batch=1, pp=2, dp=4)
    autopar.estimate(tokens, cluster, cfg)
    with pytest.raises(ValueError, match=r"pipelines the model it traced, and it trains on its "
                                         r"own example_inputs batches.*use pp=1"):
        autopar.estimate(own, cluster, cfg)
    autopar.estimate(own, cluster, cfg, framework="torchtitan")
    # `run` and `verify` of a plan made for another framework refuse it by the same field.
    from autopar.runtime.worker import pipeline_batch_problem

    assert "cannot pipeline m.py: it trains on its own example_inputs" in pipeline_batch_problem(
        "m.py", own, 2)
    assert pipeline_batch_problem("m.py", own, 1) == pipeline_batch_problem("m.py", tokens, 2) == ""
    # A profile written before the field: its own loss says it (and keeps its fingerprint).
    legacy = dataclasses.replace(own, pp_blocker="")
    assert "pp_blocker" not in legacy.to_dict() and pps(legacy, "autopar") == {1}


def test_search_offers_sp_only_where_the_runtime_shards_every_norm():
    """BLOOM normalises the token embedding's output before its blocks: autopar's runtime runs
    that norm on the whole sequence, so it is planned tp without sequence parallelism (which
    runs: tests/distributed/test_run_any_model.py), and frameworks with their own code keep it."""
    pytest.importorskip("transformers")
    from autopar.graph.types import ModelProfile
    from autopar.models.hf import from_hf_config

    bloom = autopar.profile(from_hf_config({
        "model_type": "bloom", "hidden_size": 32, "n_head": 4, "n_layer": 2, "vocab_size": 64,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}), seq_len=16)
    assert "transformer.word_embeddings_layernorm" in bloom.layers[0].tp.sp_blocker
    assert ModelProfile.from_dict(bloom.to_dict()) == bloom
    assert all("sp_blocker" not in x["tp"] for x in bloom.to_dict()["layers"][1:])
    cluster = Cluster.preset("h100", nodes=1)

    def tp_sp(framework):
        options = SearchOptions(framework=framework)
        return {(c.tp, c.sequence_parallel) for c in _candidates(bloom, cluster, 16, options)}

    assert {sp for tp, sp in tp_sp("autopar")} == {False} and max(tp_sp("autopar"))[0] > 1
    assert (2, True) in tp_sp("torchtitan")
    cfg = ParallelConfig(global_batch=8, tp=2, dp=4, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"word_embeddings_layernorm\) runs on the whole "
                                         r"sequence; use sequence_parallel=False"):
        autopar.estimate(bloom, cluster, cfg)
    autopar.estimate(bloom, cluster, dataclasses.replace(cfg, sequence_parallel=False))


def test_fused_attention_the_runtime_cannot_localize_blocks_tp():
    """nanoGPT's attention sizes its views by its input's width: on one rank's share of its
    fused q/k/v it fails, so its profile records it and the search offers autopar's runtime no
    tp (which `autopar run` refused); GPT-2's splits by its own attributes and keeps tp."""
    pytest.importorskip("transformers")
    from autopar.graph.model_text import build_and_profile

    nano = build_and_profile(str(FIXTURES / "tiny_nanogpt_targets.py"))[1]
    blocker = nano.layers[1].tp.split_blocker
    assert "does not run on one rank's share of the fused q/k/v" in blocker
    assert "fused q/k/v transformer.h.0.c_attn" in blocker
    gpt2 = autopar.profile(_tiny_hf("gpt2"), seq_len=16)
    assert all(not x.tp.split_blocker for x in gpt2.layers)
    cluster = Cluster.preset("h100", nodes=1)

    def tps(profile, framework):
        options = SearchOptions(framework=framework)
        return {c.tp for c in _candidates(profile, cluster, 16, options)}

    assert tps(nano, "autopar") == {1} and tps(nano, "torchtitan") > {1}
    assert tps(gpt2, "autopar") > {1}


def test_a_weight_shared_between_blocks_is_planned_unsplit():
    """autopar's runtime splits a shared weight only between the token embedding and the lm
    head: a block sharing one with another is planned without pp and tp for it (run refused
    the tp 2 pp 2 it had been planned)."""
    model = autopar.models.build("llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=256,
                                 seq_len=64)
    blocks = list(model.layers.values())
    for block in blocks[1:]:
        block.attention.wq.weight = blocks[0].attention.wq.weight
    shared = autopar.profile(model, seq_len=64)
    assert "shares layers.1.attention.wq.weight with layers.0.attention.wq.weight" in (
        shared.pp_blocker)
    assert [bool(x.tp.split_blocker) for x in shared.layers] == [False] + [True] * 4 + [False]
    tied = autopar.profile(autopar.models.build(
        "llama", layers=2, hidden=64, heads=4, vocab=256, seq_len=64, tie_embeddings=True))
    assert tied.tied_embeddings and not tied.pp_blocker
    cluster = Cluster.preset("h100", nodes=1)

    def splits(profile, framework):
        options = SearchOptions(framework=framework, max_virtual_stages=2)
        return {(c.tp, c.pp) for c in _candidates(profile, cluster, 16, options)}

    assert splits(shared, "autopar") == {(1, 1)}
    assert {(2, 2), (1, 2), (2, 1)} <= splits(shared, "torchtitan")
