"""A model that trains with its own loss (``ModelProfile.own_loss``: a model file's ``loss_fn``)
gets all-gathered logits in autopar's runtime under tp, not the vocab-parallel loss, and the
autopar record charges that: the logits all-gather and whole logits on the last stage. Frameworks
that run their own model code keep their vocab-parallel loss."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import autopar
from autopar import Cluster, ParallelConfig
from autopar.cost_model.layer_costs import build_cost_table
from autopar.graph.model_text import build_and_profile
from autopar.graph.types import ModelProfile

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"
PROFILE = autopar.profile(autopar.models.build("llama", layers=2, hidden=64, heads=4, kv_heads=2,
                                               vocab=32768, seq_len=1024))
CLUSTER = Cluster.preset("h100", nodes=1)
CFG = ParallelConfig(tp=4, micro_batch=2, global_batch=4)


def _head(profile: ModelProfile, framework: str):
    return build_cost_table(profile, CLUSTER, CFG, framework).layers[-1]


def test_a_model_files_loss_is_recorded_and_kept_in_json():
    _model, prof = build_and_profile(str(FIXTURES / "tiny_nanogpt_targets.py"))
    assert prof.own_loss and prof.to_dict()["own_loss"] is True
    assert ModelProfile.from_dict(prof.to_dict()) == prof
    assert "own_loss" not in PROFILE.to_dict()


def test_autopar_charges_whole_logits_for_its_own_loss():
    own = dataclasses.replace(PROFILE, own_loss=True)
    default, gathered = _head(PROFILE, "autopar"), _head(own, "autopar")
    # The b s V all-gather (134 MB here) against three all-reduces of b s fp32.
    assert gathered.tp_comm_s[0] > 2 * default.tp_comm_s[0]
    assert gathered.act_bytes[0] > default.act_bytes[0]  # whole logits and log-probabilities
    assert _head(own, "torchtitan") == _head(PROFILE, "torchtitan")
