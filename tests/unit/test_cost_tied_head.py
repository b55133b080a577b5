"""A lm head tied to the token embedding, split from it by the pipeline: the last stage holds a
copy of the weight (with its gradient and optimizer state) and the step all-reduces the copy's
gradient between the two ends, as autopar's runtime (runtime/tied_weights.py) and Megatron-LM
run it; with pp == 1 the weight is one parameter."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.config import ParallelConfig
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.tied_head import copied_params, split_tied_head, tied_sync_s

SHAPE = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 4096, "seq_len": 64}


def _profile(tied: bool):
    model = autopar.models.build("gpt", tie_embeddings=tied, **SHAPE)
    return autopar.profile(model, seq_len=SHAPE["seq_len"])


def test_the_head_holds_a_copy_only_across_a_pipeline_split() -> None:
    tied, untied = _profile(True), _profile(False)
    assert tied.num_params == untied.num_params - SHAPE["vocab"] * SHAPE["hidden"]
    assert split_tied_head(tied, 1) is tied and copied_params(untied, 4) == 0
    split = split_tied_head(tied, 2)
    assert split.num_params == untied.num_params  # each end holds the weight
    assert [x.num_params for x in split.layers] == [x.num_params for x in untied.layers]


def test_the_last_stage_is_charged_the_copy_and_the_step_its_gradient_sync() -> None:
    cluster = Cluster.preset("a100-80g", nodes=1, gpus_per_node=2)
    cfg = ParallelConfig(pp=2, global_batch=8, schedule="1f1b")
    tied, untied = _profile(True), _profile(False)
    est_tied = autopar.estimate(tied, cluster, cfg)
    est_untied = autopar.estimate(untied, cluster, cfg)
    last = lambda est: est.stages[-1].memory  # noqa: E731
    # The head's memory is the untied model's: its copy, gradient and Adam state.
    assert last(est_tied).parameters_bytes == pytest.approx(last(est_untied).parameters_bytes)
    assert last(est_tied).optimizer_bytes == pytest.approx(last(est_untied).optimizer_bytes)
    sync = tied_sync_s(tied, cluster, cfg, 4)
    assert sync > 0
    assert est_tied.time_breakdown.optimizer_s == pytest.approx(
        est_untied.time_breakdown.optimizer_s + sync)
    # One rank holds both ends under a V-shaped schedule: the copies add in place.
    zbv = dataclasses.replace(cfg, schedule="zbv-zero-bubble", virtual_stages=2)
    assert tied_sync_s(tied, cluster, zbv, 4) == 0.0
    # Without a pipeline the weight is one parameter, held once.
    one = ParallelConfig(tp=2, global_batch=8)
    assert autopar.estimate(tied, cluster, one).memory_per_gpu_bytes < autopar.estimate(
        untied, cluster, one).memory_per_gpu_bytes
