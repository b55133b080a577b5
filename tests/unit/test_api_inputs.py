"""The Python API's inputs: a Plan owns its data and is checked when made, as when read; numbers
too large for a float are named, not raised as OverflowError."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

# The small model, cluster, config and plan of the plan-and-cluster tests.
from test_plan_cluster import CLUSTER, CONFIG, _plan
from test_plan_cluster import TINY as PROFILE

import autopar
from autopar.cli import main
from autopar.errors import ClusterConfigError
from autopar.plan import PlanFormatError
from tests.fixtures.profiles import analytic_transformer_profile
from tests.helpers import one_error_line


def test_a_plan_owns_its_cluster_dict() -> None:
    plan = _plan()
    text = plan.to_json()
    data = plan.to_dict()
    data["cluster"]["nodes"] = 99
    data["cluster"]["device"]["memory_bytes"] = 1
    assert plan.to_json() == text  # the caller's edit of to_dict()'s output did not reach it
    source = json.loads(text)
    loaded = autopar.Plan.from_dict(source)
    source["cluster"]["device"]["name"] = "changed"
    assert loaded.to_json() == text  # nor an edit of what from_dict was given
    assert autopar.Plan.from_json(loaded.to_json()) == loaded


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("model", "a\nb", "plan model must be one line of printable text"),
    ("model", 5, "plan model must be a string"),
    ("seq_len", "32", "plan seq_len must be a whole number"),
    ("seq_len", -5, "plan seq_len must be from 0 to 16,777,216"),
    ("loss", "nope", "plan field loss must be one of eager, fused"),
])
def test_a_plan_is_checked_when_made_as_when_read(field, value, needle) -> None:
    with pytest.raises(PlanFormatError, match=needle):
        dataclasses.replace(_plan(), **{field: value})


def test_an_integer_too_large_for_a_float_is_named(tmp_path, capfd) -> None:
    doc = _plan().to_dict()
    doc["estimate"]["tokens_per_s"] = 10**400
    with pytest.raises(PlanFormatError, match=r"estimate\.tokens_per_s is far too large"):
        autopar.Plan.from_dict(doc)
    file = tmp_path / "p.json"
    file.write_text(json.dumps(doc))
    one_error_line(main(["show", str(file)]), *capfd.readouterr(), "is far too large")
    cluster = CLUSTER.to_dict()
    cluster["device"]["peak_bf16_flops"] = 10**400
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(yaml.safe_dump(cluster))
    with pytest.raises(ClusterConfigError, match="peak_bf16_flops is far too large"):
        autopar.Cluster.from_yaml(yaml_file)


SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seq_len=32)


@pytest.mark.parametrize(("changes", "error", "needle"), [
    (dict(tie_embeddings="false"), ValueError, "tie_embeddings must be True or False"),
    (dict(hidden=0), ValueError, "hidden must be a positive integer, got 0"),  # not ffn_hidden
    (dict(hidden="64"), ValueError, "hidden must be a positive integer"),
    (dict(experts=10**30, top_k=1), ValueError, "experts must be at most 65,536"),
    (dict(dtype=5), ValueError, "dtype 5 is not one autopar trains in"),
    (dict(dtype="int8"), ValueError, "dtype 'int8' is not one autopar trains in"),
    (dict(device="nope"), ValueError, "device 'nope' is not a torch device"),
])
def test_build_names_the_bad_argument(changes, error, needle) -> None:
    with pytest.raises(error, match=needle):
        autopar.models.build("llama", **{**SHAPE, **changes})


def test_build_takes_dtype_names_and_checks_its_other_inputs() -> None:
    import torch

    model = autopar.models.build("llama", dtype="bf16", **SHAPE)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dropout must be a number in"):
        autopar.models.build("gpt", layers=2, hidden=64, heads=4, vocab=256, seq_len=32,
                             dropout="0.1")
    with pytest.raises(TypeError, match="must be named by a string"):
        autopar.models.build(5, **SHAPE)


@pytest.mark.parametrize(("call", "needle"), [
    (lambda: autopar.estimate(PROFILE, CLUSTER, {"dp": 8, "global_batch": 16}),
     "takes a ParallelConfig or a Plan, got dict"),
    (lambda: autopar.estimate(None, CLUSTER, CONFIG), r"estimate\(\) takes a ModelProfile"),
    (lambda: autopar.estimate(PROFILE, "h100", CONFIG), r"estimate\(\) takes a Cluster"),
    (lambda: autopar.plan(PROFILE, None, 16), r"plan\(\) takes a Cluster"),
    (lambda: autopar.plan(PROFILE, CLUSTER, 16, seq_len="128"), "seq_len must be an integer"),
    (lambda: autopar.Cluster.preset(None), "a cluster preset is named by a string"),
])
def test_wrong_types_are_named(call, needle) -> None:
    with pytest.raises(TypeError, match=needle):
        call()


@pytest.mark.parametrize(("changes", "needle"), [
    (dict(nodes="2"), "cluster field nodes must be a whole number, got '2'"),
    (dict(nodes=2.0), "cluster field nodes must be a whole number, got 2.0"),
    (dict(gpus_per_node=True), "cluster field gpus_per_node must be a number"),
    (dict(param_traffic_factor="0.5"), "cluster field param_traffic_factor must be a number"),
])
def test_a_cluster_holds_whole_counts(changes, needle) -> None:
    with pytest.raises(ClusterConfigError, match=needle):
        dataclasses.replace(CLUSTER, **changes)
    # The cpu preset names its worker count, not the per-worker rate it would divide down.
    with pytest.raises(ClusterConfigError, match="gpus_per_node must be a whole number"):
        autopar.Cluster.preset("cpu", gpus_per_node=10**7)


@pytest.mark.parametrize(("changes", "needle"), [
    (dict(memory_headroom_bytes=-1e15), "memory_headroom_bytes must be a finite number >= 0"),
    (dict(memory_headroom_bytes=float("nan")), "memory_headroom_bytes must be a finite"),
    (dict(time_limit_s=float("nan")), "time_limit_s must be a finite number"),
    (dict(max_tp=2.5), "max_tp must be a whole number"),
    (dict(max_virtual_stages=10**30), "max_virtual_stages must be a whole number from 2"),
    (dict(robust="yes"), "robust must be True or False"),
    (dict(micro_batch_sizes=(1, "2")), "micro_batch_sizes must be a whole number"),
])
def test_search_options_refuse_what_they_would_misread(changes, needle) -> None:
    from autopar.search.options import SearchOptions

    with pytest.raises(ValueError, match=needle):
        SearchOptions(**changes)


def test_plan_documents_are_read_strictly(tmp_path) -> None:
    text = _plan().to_json()
    with pytest.raises(PlanFormatError, match="gives the key 'loss' twice"):
        autopar.Plan.from_json(text.replace('"config":', '"loss": "fused", "loss": "eager", '
                                            '"config":', 1))
    doc = json.loads(text)
    with pytest.raises(PlanFormatError, match="the plan has an unknown field 'los'"):
        autopar.Plan.from_dict({**doc, "los": "fused"})
    stage = {**doc["stages"][0], "recompte": []}
    with pytest.raises(PlanFormatError, match=r"stages\[0\] has an unknown field 'recompte'"):
        autopar.Plan.from_dict({**doc, "stages": [stage, *doc["stages"][1:]]})
    # A recorded cluster's names are shown: a terminal control in one is refused, not shown,
    # also in a hand-made plan's partial cluster.
    for cluster in (doc["cluster"], {"nodes": 1, "gpus_per_node": 8}):
        named = {**cluster, "name": "x\n\x1b[31mFAKE LINE"}
        with pytest.raises(PlanFormatError, match="name must be one line of printable text"):
            autopar.Plan.from_dict({**doc, "cluster": named})


def test_a_plan_framework_is_kept_in_its_canonical_spelling() -> None:
    spec = "megatron-lm+tp-comm-overlap+overlap-grad-reduce"
    from autopar.cost_model.frameworks import get_framework

    canonical = get_framework(spec).spec
    doc = {**_plan().to_dict(), "framework": spec}
    assert autopar.Plan.from_dict(doc).framework == canonical
    assert canonical != spec  # the settings sorted


def test_config_and_cluster_files_name_their_faults(tmp_path) -> None:
    with pytest.raises(ValueError, match="read from an object of its fields, got NoneType"):
        autopar.ParallelConfig.from_dict(None)
    with pytest.raises(ValueError, match="unknown ParallelConfig field"):
        autopar.ParallelConfig.from_dict({1: 2, "global_batch": 16})
    with pytest.raises(ClusterConfigError, match=r"cannot write cluster file .*: Is a directory"):
        CLUSTER.to_yaml(tmp_path)


def test_profile_and_plan_parts_name_wrong_types() -> None:
    plan = _plan()
    with pytest.raises(TypeError, match=r"profile\(\) takes a torch nn.Module"):
        autopar.profile("llama")
    with pytest.raises(TypeError, match=r"for_cluster\(\) takes a Cluster, got NoneType"):
        plan.for_cluster(None)
    for field, value in (("tp_layout", None), ("config", {}), ("estimate", None)):
        with pytest.raises(PlanFormatError, match=f"plan {field} must be of type"):
            dataclasses.replace(plan, **{field: value})


def test_an_estimate_that_fits_holds_its_memory() -> None:
    doc = _plan().to_dict()
    doc["estimate"]["memory_per_gpu_bytes"] = 10**300
    with pytest.raises(PlanFormatError, match="says it fits, but its memory_per_gpu_bytes"):
        autopar.Plan.from_dict(doc)


def test_a_plan_is_re_targeted_at_another_profile_on_purpose() -> None:
    plan = _plan()
    other = analytic_transformer_profile(4, 256, 8, 1024, 256)
    with pytest.raises(ValueError, match=r"plan\.for_profile\(profile\)"):
        autopar.estimate(other, CLUSTER, plan)
    moved = plan.for_profile(other)
    assert moved.profile_fingerprint == other.fingerprint() and moved.stages == plan.stages
    assert autopar.estimate(other, CLUSTER, moved).step_time_s > 0


def test_search_counts_are_bounded() -> None:
    doc = _plan().to_dict()
    doc["search"]["candidates_considered"] = 10**300
    with pytest.raises(PlanFormatError, match=r"search\.candidates_considered must be from 0"):
        autopar.Plan.from_dict(doc)


def test_numbers_are_held_as_the_file_reader_holds_them() -> None:
    import numpy as np

    from autopar.search.options import SearchOptions

    options = SearchOptions(memory_headroom_bytes=np.float32(2**20), max_tp=np.int64(4),
                            zero_stages=(np.int64(0), np.int64(1)))
    assert type(options.memory_headroom_bytes) is float and type(options.max_tp) is int
    assert options.zero_stages == (0, 1) and all(type(z) is int for z in options.zero_stages)
    assert autopar.plan(PROFILE, CLUSTER, 16, options=options).estimate.fits
    # An int in a rate's field: the float a file read back holds, and its fingerprint.
    cluster = dataclasses.replace(CLUSTER, param_traffic_factor=0)
    assert type(cluster.param_traffic_factor) is float
    assert cluster.fingerprint() == autopar.Cluster.from_dict(cluster.to_dict()).fingerprint()
