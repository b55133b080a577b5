"""CLI flags and exports of cp, HSDP, offload and precision (in process, tiny models)."""

from __future__ import annotations

import json
import typing

import pytest

from autopar.cli import main
from autopar.config import ParallelConfig
from autopar.cost_model.hardware import Cluster
from autopar.exporters import export_plan
from autopar.search import plan_from_config
from tests.fixtures.profiles import analytic_transformer_profile
from tests.helpers import one_error_line

TINY = "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,seq_len=64"
PROFILE = analytic_transformer_profile(2, 256, 4, 512, 1024, kv_heads=2, gated_mlp=True,
                                       ffn_hidden=512, dropout=False, bias=False,
                                       position_embeddings=False, tied_embeddings=False)


def _json(capfd, argv) -> dict:
    assert main(argv) == 0
    out, _ = capfd.readouterr()
    return json.loads(out)


def test_estimate_takes_the_new_dimensions(capfd) -> None:
    doc = _json(capfd, ["estimate", TINY, "--gpu", "h100", "--gpus", "8", "--dp", "4", "--cp",
                        "2", "--zero", "3", "--dp-replicate", "2", "--offload", "params",
                        "--global-batch", "8", "--framework", "torchtitan", "--dtype", "fp8",
                        "--json"])
    cfg = doc["config"]
    assert (cfg["cp"], cfg["dp_replicate"], cfg["offload"], cfg["dtype"]) == (2, 2, "params",
                                                                             "fp8")
    assert doc["estimate"]["host_memory_per_gpu_bytes"] > 0
    assert "fp8" in doc["estimate"]["precision"]


def test_plan_switches_restrict_the_space(capfd) -> None:
    doc = _json(capfd, ["plan", TINY, "--gpu", "v100-32g", "--gpus", "8", "--global-batch", "8",
                        "--no-cp", "--no-hsdp", "--no-offload", "--json"])
    cfg = doc["config"]
    assert (cfg["cp"], cfg["dp_replicate"], cfg["offload"], cfg["dtype"]) == (1, 1, "none",
                                                                             "fp16")
    doc = _json(capfd, ["plan", TINY, "--gpu", "v100-32g", "--gpus", "8", "--global-batch", "8",
                        "--dtype", "fp32", "--json"])
    assert doc["config"]["dtype"] == "fp32"


@pytest.mark.parametrize(("extra", "needle"), [
    (["--cp", "3", "--dp", "2", "--gpus", "6", "--zero", "3"], "multiple of 2 * cp"),
    (["--dp", "8", "--dtype", "fp8", "--gpu", "a100-80g"], "needs fp8 tensor cores"),
    (["--dp", "8", "--dtype", "fp8", "--gpu", "h100"], "autopar trains in bf16"),
    (["--dp", "8", "--zero", "3", "--offload", "params", "--gpu", "cpu"], "host_memory"),
])
def test_bad_dimension_inputs_are_one_line(capfd, extra, needle) -> None:
    argv = ["estimate", TINY, "--global-batch", "8", *extra]
    if "--gpus" not in extra:
        argv += ["--gpus", "8"]
    one_error_line(main(argv), *capfd.readouterr(), needle)


def _plan(framework: str, **fields):
    cfg = ParallelConfig(global_batch=16, **fields)
    return plan_from_config(PROFILE, Cluster.preset("h100", nodes=2), cfg, framework=framework)


def test_torchtitan_export_carries_cp_hsdp_offload_and_fp8() -> None:
    text = export_plan(_plan("torchtitan", dp=4, cp=2, tp=2, zero=3, dp_replicate=2,
                             dtype="fp8", offload="params"), "torchtitan").text
    for line in ("context_parallel_degree = 2", "data_parallel_replicate_degree = 2",
                 "data_parallel_shard_degree = 2", "enable_cpu_offload = true",
                 'converters = ["quantize.linear.float8"]', "[quantize.linear.float8]",
                 'recipe_name = "tensorwise"', 'context_parallel_rotate_method = "allgather"'):
        assert line in text, line
    # The fp8 speed it was costed at is torchao's compiled one (eager fp8 is slower than bf16).
    assert "[compile]\nenable = true" in text
    assert "[compile]" not in export_plan(_plan("torchtitan", dp=16, zero=3), "torchtitan").text
    ring = export_plan(_plan("torchtitan+cp-rotate-alltoall", dp=8, cp=2, zero=3),
                       "torchtitan").text  # what each prediction charged
    assert 'context_parallel_rotate_method = "alltoall"' in ring
    assert "enable_fsdp_float8_all_gather" not in text  # the setting is off by default
    gathered = export_plan(_plan("torchtitan+float8-all-gather", dp=16, zero=3, dtype="fp8"),
                           "torchtitan").text
    assert "enable_fsdp_float8_all_gather = true" in gathered


def test_float8_all_gather_halves_the_fsdp_gathers_of_fp8_blocks() -> None:
    """torchtitan's enable_fsdp_float8_all_gather: a block's parameter all-gathers move 1 byte
    per parameter instead of 2; its reductions, non-fp8 units and the default are unchanged."""
    from autopar.cost_model.dp_comm import dp_collectives, framework_dp_collectives
    from autopar.cost_model.frameworks import get_framework

    cfg = ParallelConfig(dp=8, global_batch=16, zero=3, dtype="fp8")
    own = dp_collectives(cfg, 1e8)
    on = get_framework("torchtitan+float8-all-gather")

    def sizes(fw, fp8_linears: bool) -> list[tuple[str, float]]:
        return [(c.kind, c.size_bytes) for c in framework_dp_collectives(
            own, cfg, fw, fp8_linears=fp8_linears)]

    plain = sizes(get_framework("torchtitan"), True)
    assert sizes(on, False) == plain
    for (kind, size), (kind_on, size_on) in zip(plain, sizes(on, True)):
        assert kind == kind_on
        assert size_on == (size / 2 if kind == "all_gather_into_tensor" else size)


def test_megatron_and_deepspeed_exports() -> None:
    flags = export_plan(_plan("megatron-lm", dp=4, cp=2, tp=2, zero=1, dp_replicate=2,
                              dtype="fp8", offload="optimizer"), "megatron").text
    for flag in ("--context-parallel-size 2", "--fp8-format hybrid", "--bf16",
                 "--num-distributed-optimizer-instances 2", "--optimizer-cpu-offload",
                 "--use-precision-aware-optimizer", "--use-distributed-optimizer"):
        assert flag in flags, flag
    doc = json.loads(export_plan(_plan("deepspeed", dp=16, zero=3, offload="params"),
                                 "deepspeed").text)
    assert doc["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert doc["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


@pytest.mark.parametrize(("to", "fields", "needle"), [
    ("deepspeed", {"dp": 8, "cp": 2, "zero": 3}, "no context parallelism"),
    ("deepspeed", {"dp": 16, "zero": 3, "dp_replicate": 2}, "no HSDP"),
    ("torchtitan", {"dp": 16, "zero": 3, "offload": "optimizer"}, "not 'optimizer'"),
    ("megatron", {"dp": 16, "zero": 1, "dtype": "fp8", "offload": "none"}, None),
    ("deepspeed", {"dp": 16, "zero": 1, "dtype": "fp8"}, "not fp8"),
])
def test_exports_refuse_what_the_tool_cannot_run(to, fields, needle) -> None:
    plan = _plan("torchtitan" if fields.get("cp", 1) > 1 or fields.get("dtype") == "fp8"
                 or fields.get("dp_replicate", 1) > 1 else "autopar", **fields)
    if needle is None:  # Megatron runs this one
        assert "--fp8-format hybrid" in export_plan(plan, to).text
        return
    with pytest.raises(ValueError, match=needle):
        export_plan(plan, to)


def test_torchtitan_loads_the_new_dimensions(tmp_path) -> None:
    """torchtitan 0.2.2's ConfigManager reads every key of the export at its declared type,
    and its ParallelDims accepts the degrees (dp_replicate x dp_shard x cp x tp)."""
    from tests.unit.test_export_real_tools import _fits_type, _require, _torchtitan_job

    plan = _plan("torchtitan+float8-all-gather", dp=4, cp=2, tp=2, zero=3, dp_replicate=2,
                 dtype="fp8", offload="params")
    job, doc = _torchtitan_job(plan, tmp_path)

    def read_back(obj, table: dict) -> None:  # nested tables ([quantize.linear.float8]) too
        hints = typing.get_type_hints(type(obj))
        for key, value in table.items():
            if isinstance(value, dict):
                read_back(getattr(obj, key), value)
            else:
                assert getattr(obj, key) == value and _fits_type(value, hints[key]), key

    read_back(job, doc)
    par = job.parallelism
    dims = _require("torchtitan.distributed.parallel_dims").ParallelDims(
        dp_replicate=par.data_parallel_replicate_degree, dp_shard=par.data_parallel_shard_degree,
        cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
        pp=par.pipeline_parallel_degree, ep=1, etp=1, world_size=16)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (2, 2, 2, 2)
    assert job.training.enable_cpu_offload and job.model.converters == ["quantize.linear.float8"]
    assert job.quantize.linear.float8.enable_fsdp_float8_all_gather
    assert job.compile.enable and "model" in job.compile.components


def test_plan_max_virtual_stages_bounds_the_chunks_a_rank_holds(capfd) -> None:
    """GPT-3 175B on 1024 A100s is planned with 4 chunks a rank by default; at most 2 when
    told, and a bound below 2 is one line."""
    argv = ["plan", "gpt3-175b", "--gpus", "1024", "--gpu", "a100-80g", "--global-batch",
            "1536", "--json"]
    assert _json(capfd, argv)["config"]["virtual_stages"] == 4
    assert _json(capfd, [*argv, "--max-virtual-stages", "2"])["config"]["virtual_stages"] <= 2
    one_error_line(main([*argv, "--max-virtual-stages", "1"]), *capfd.readouterr(),
                   "--max-virtual-stages")


def test_plan_min_cp_tokens_moves_the_context_parallel_floor(capfd) -> None:
    """llama3-8b at 32,768 tokens on 8 H100: by default no cp rank holds under 8,192 tokens;
    `--min-cp-tokens 4096` lets the search reach cp=8 (4,096 a rank), which it predicts faster,
    and the floor still holds."""
    argv = ["plan", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--global-batch", "8",
            "--seq-len", "32768", "--framework", "megatron-lm", "--json"]
    default = _json(capfd, argv)
    lowered = _json(capfd, [*argv, "--min-cp-tokens", "4096"])
    assert 32768 // default["config"]["cp"] >= 8192
    assert lowered["config"]["cp"] == 8
    assert lowered["estimate"]["step_time_s"] < default["estimate"]["step_time_s"]
    one_error_line(main([*argv, "--min-cp-tokens", "0"]), *capfd.readouterr(),
                   "--min-cp-tokens")


def test_plan_help_names_the_search_cp_floor(capsys) -> None:
    from autopar.search.options import MIN_CP_TOKENS

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert f"(default {MIN_CP_TOKENS})" in " ".join(capsys.readouterr().out.split())
