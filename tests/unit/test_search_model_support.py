"""Plans autopar's runtime can run: it shards the zoo's attention and experts over cp and ep,
so a Hugging Face model or a model file is planned for it without them (and for a framework
that runs its own implementation of the architecture, with them)."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.search import SearchOptions
from autopar.search.planner import _candidates

SEQ = 16_384


@pytest.fixture(scope="module")
def moe_profile():
    model = autopar.models.build("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256,
                                 seq_len=SEQ, experts=4, top_k=2)
    return autopar.profile(model, seq_len=SEQ)


def test_zoo_profiles_say_so_and_keep_their_json(moe_profile):
    assert moe_profile.zoo_modules and "zoo_modules" not in moe_profile.to_dict()
    hf = dataclasses.replace(moe_profile, zoo_modules=False)
    assert hf.to_dict()["zoo_modules"] is False
    assert type(hf).from_dict(hf.to_dict()) == hf
    assert type(hf).from_dict(moe_profile.to_dict()) == moe_profile


def test_hf_config_profiles_are_not_zoo():
    pytest.importorskip("transformers")
    from autopar.models.hf import from_hf_config

    model = from_hf_config({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                            "num_hidden_layers": 1, "num_attention_heads": 4,
                            "vocab_size": 64, "max_position_embeddings": 16})
    assert not autopar.profile(model, seq_len=16).zoo_modules


def _dims(profile, framework: str) -> set[tuple[int, int]]:
    cluster = Cluster.preset("h100", nodes=2)
    options = SearchOptions(framework=framework, max_virtual_stages=2)
    return {(c.cp, c.ep) for c in _candidates(profile, cluster, 16, options)}


def test_search_offers_cp_and_ep_only_where_the_runtime_runs_them(moe_profile):
    zoo = _dims(moe_profile, "autopar")
    assert any(cp > 1 for cp, _ in zoo) and any(ep > 1 for _, ep in zoo)
    other = dataclasses.replace(moe_profile, zoo_modules=False)
    assert _dims(other, "autopar") == {(1, 1)}
    titan = _dims(other, "torchtitan")
    assert any(cp > 1 for cp, _ in titan) and any(ep > 1 for _, ep in titan)


def test_estimate_names_why(moe_profile):
    other = dataclasses.replace(moe_profile, zoo_modules=False)
    cluster = Cluster.preset("h100", nodes=1)
    for dims in ({"cp": 2, "dp": 4}, {"ep": 2, "dp": 8, "zero": 1}):
        cfg = ParallelConfig(global_batch=8, micro_batch=1, **dims)
        autopar.estimate(moe_profile, cluster, cfg)  # the zoo model runs it
        with pytest.raises(ValueError, match=r"zoo models only .*--framework torchtitan"):
            autopar.estimate(other, cluster, cfg)
        autopar.estimate(other, cluster, cfg, framework="torchtitan")
