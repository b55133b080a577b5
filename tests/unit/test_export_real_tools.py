"""Exports of four plans loaded by the real tools: torchtitan's ConfigManager and ParallelDims,
DeepSpeed's DeepSpeedConfig with the plan's topology, Megatron-LM's encoded validate_args, and
the slurm script through ``bash -n``.

The plans: pp = 1 (dp 8, ZeRO 1), pp > 1 interleaved (dp 2 x pp 4, 2 chunks a rank), ZeRO 3
(dp 8, full recompute) and tp > 1 pp > 1 (dp 2 x tp 2 x pp 2). A tool that cannot run a plan
must refuse it by name (``export_refusal``) instead of writing a document it would reject.
torchtitan and DeepSpeed are pinned in requirements-dev.txt; under CI a missing one fails the
test instead of skipping it.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import shlex
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

import autopar
from autopar.cost_model.frameworks import get_framework
from autopar.export_rules import MegatronArgs, deepspeed_unknown_keys, megatron_violations
from autopar.exporters import export_plan, export_refusal
from autopar.search import plan_from_config
from tests.fixtures.profiles import analytic_transformer_profile

ROOT = Path(__file__).resolve().parents[2]
SEQ_LEN = 128
PROFILE = analytic_transformer_profile(8, 256, 8, 1024, SEQ_LEN)
CLUSTER = autopar.Cluster.preset("a100-80g", nodes=1)
CONFIGS = {
    "pp1": autopar.ParallelConfig(dp=8, micro_batch=2, global_batch=64, zero=1),
    "interleaved": autopar.ParallelConfig(dp=2, pp=4, micro_batch=1, global_batch=16,
                                          schedule="interleaved-1f1b", virtual_stages=2),
    "zero3": autopar.ParallelConfig(dp=8, micro_batch=1, global_batch=32, zero=3,
                                    recompute="full"),
    "tp_pp": autopar.ParallelConfig(dp=2, tp=2, pp=2, micro_batch=2, global_batch=32,
                                    recompute="selective"),
}
# (plan, format) -> the words of its refusal: what the tool cannot run.
REFUSED = {("interleaved", "deepspeed"): "pipeline schedules 1f1b",
           ("zero3", "megatron"): "ZeRO stages (0, 1)"}


def _require(module: str) -> types.ModuleType:
    """Import ``module``; skip when it is not installed, except under CI (there it must be)."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason="install requirements-dev.txt")


# The DeepSpeed settings a plan's prediction assumed, which its export writes (checkpoints.py).
DEEPSPEED_SPECS = {"zero3": "deepspeed+partition-activations+cpu-checkpointing"}


@functools.cache
def _plan(name: str, framework: str = "autopar") -> autopar.Plan:
    return plan_from_config(PROFILE, CLUSTER, CONFIGS[name], framework=framework)


def _ds_plan(name: str) -> autopar.Plan:
    return _plan(name, DEEPSPEED_SPECS.get(name, "autopar"))


@pytest.mark.parametrize(("name", "to"), sorted(REFUSED))
def test_a_tool_that_cannot_run_the_plan_refuses_it(name, to):
    reason = export_refusal(_plan(name), to)
    assert reason is not None and REFUSED[name, to] in reason
    with pytest.raises(ValueError, match="re-plan for it"):
        export_plan(_plan(name), to)


# ------------------------------------------------------------------------------- torchtitan
def _fits_type(value: Any, hint: Any) -> bool:
    """``value`` is of the annotated type ``hint`` (Literal, unions, lists, scalars)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_fits_type(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_fits_type(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) and not (hint is int and isinstance(value, bool))


def _torchtitan_job(plan: autopar.Plan, tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    """torchtitan's JobConfig of the exported TOML (its ConfigManager) and the TOML as read."""
    import tomllib

    manager = _require("torchtitan.config.manager")
    path = tmp_path / "job.toml"
    path.write_text(export_plan(plan, "torchtitan").text)
    job = manager.ConfigManager().parse_args(["--job.config_file", str(path)])
    return job, tomllib.loads(path.read_text())


def _torchtitan_batches(job: Any, dims: Any, pp: int) -> tuple[int, int, int]:
    """(sequences a forward runs, pipeline micro-batches a forward-backward, gradient
    accumulation steps), as torchtitan v0.2.2 derives them: ``train.py`` (accumulation =
    global // (local x dp)) and ``distributed/pipeline_parallel.py`` ``build_pipeline_schedule``
    (pp > 1: the local batch is split into ``local // pipeline_parallel_microbatch_size``
    micro-batches, one schedule run)."""
    local, glob = job.training.local_batch_size, job.training.global_batch_size
    batch_degree = dims.dp_replicate * dims.dp_shard
    assert glob % (local * batch_degree) == 0, "train.py asserts this divisibility"
    accumulation = glob // (local * batch_degree)
    if pp == 1:
        return local, 1, accumulation
    micro = job.parallelism.pipeline_parallel_microbatch_size
    assert local % micro == 0, "build_pipeline_schedule raises ValueError otherwise"
    return micro, local // micro, accumulation


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_torchtitan_loads_the_toml_with_the_plans_split(name, tmp_path):
    plan, cfg = _plan(name), CONFIGS[name]
    job, doc = _torchtitan_job(plan, tmp_path)
    for section, table in doc.items():  # every value set, read back at its declared type
        obj = getattr(job, section)
        hints = typing.get_type_hints(type(obj))
        for key, value in table.items():
            assert getattr(obj, key) == value, (section, key)
            assert _fits_type(value, hints[key]), (section, key, value, hints[key])
    par = job.parallelism
    parallel_dims = _require("torchtitan.distributed.parallel_dims")
    dims = parallel_dims.ParallelDims(
        dp_replicate=par.data_parallel_replicate_degree, dp_shard=par.data_parallel_shard_degree,
        cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
        pp=par.pipeline_parallel_degree, ep=1, etp=1, world_size=cfg.world_size)
    assert (dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp) == (cfg.dp, cfg.tp, cfg.pp)
    micro, in_pipeline, accumulation = _torchtitan_batches(job, dims, cfg.pp)
    assert micro == cfg.micro_batch
    if cfg.pp == 1:  # torchtitan's local batch is the plan's micro-batch, accumulated
        assert job.training.local_batch_size == cfg.micro_batch
        assert accumulation == cfg.num_microbatches
    else:  # all the plan's micro-batches go through one schedule run, as the plan's bubble
        assert (in_pipeline, accumulation) == (cfg.num_microbatches, 1)
    assert job.training.seq_len == SEQ_LEN
    assert job.activation_checkpoint.mode == cfg.recompute


@pytest.mark.parametrize("name", ["interleaved", "tp_pp"])
def test_torchtitan_runs_the_plans_stages_on_the_plans_ranks(name, tmp_path):
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    plan, cfg = _plan(name), CONFIGS[name]
    job, _ = _torchtitan_job(plan, tmp_path)
    par = job.parallelism
    schedule = get_schedule_class(par.pipeline_parallel_schedule)  # as torchtitan looks it up
    assert issubclass(schedule, PipelineScheduleMulti) == (cfg.virtual_stages > 1)
    parts = par.module_fqns_per_model_part
    assert len(parts) == cfg.pp * cfg.virtual_stages and len(parts) % cfg.pp == 0
    blocks = PROFILE.num_blocks
    assert [m for part in parts for m in part] == [
        "tok_embeddings", *(f"layers.{i}" for i in range(blocks)), "norm", "output"]
    for part, stage in zip(parts, plan.stages, strict=True):
        ours = [n for n in stage.layer_names if n.startswith("layers.")]
        assert [m for m in part if m.startswith("layers.")] == ours
        # torchtitan's pipeline_module_split places stage i on rank i % pp (loop style)
        assert stage.index % cfg.pp == plan.rank_of_stage(stage.index)


# ---------------------------------------------------------------------------------- Megatron
def _megatron_args(plan: autopar.Plan) -> MegatronArgs:
    """The exported flags parsed back into the arguments Megatron's validate_args checks."""
    words = shlex.split(export_plan(plan, "megatron").text.replace("\\\n", " "))
    flags: dict[str, str | bool] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else "--"
            flags[word] = True if nxt.startswith("--") else nxt

    def num(flag: str) -> int | None:
        return int(flags[flag]) if flag in flags else None

    return MegatronArgs(
        world_size=plan.config.world_size, num_layers=PROFILE.num_blocks,
        tp=num("--tensor-model-parallel-size"), pp=num("--pipeline-model-parallel-size"),
        micro_batch=num("--micro-batch-size"), global_batch=num("--global-batch-size"),
        sequence_parallel="--sequence-parallel" in flags,
        layers_per_virtual=num("--num-layers-per-virtual-pipeline-stage"),
        virtual_per_rank=num("--num-virtual-stages-per-pipeline-rank"),
        first_layers=num("--decoder-first-pipeline-num-layers"),
        last_layers=num("--decoder-last-pipeline-num-layers"),
        recompute_granularity=flags.get("--recompute-granularity"),
        recompute_method=flags.get("--recompute-method"),
        recompute_num_layers=num("--recompute-num-layers"),
        distributed_optimizer="--use-distributed-optimizer" in flags,
        torch_fsdp2="--use-torch-fsdp2" in flags,
        gradient_accumulation_fusion="--no-gradient-accumulation-fusion" not in flags,
        untie_embeddings="--untie-embeddings-and-output-weights" in flags,
        fp16="--fp16" in flags, bf16="--bf16" in flags,
        grad_reduce_in_bf16="--grad-reduce-in-bf16" in flags)


@pytest.mark.parametrize("name", ["pp1", "interleaved", "tp_pp"])
def test_megatron_flags_pass_the_encoded_validate_args(name):
    plan, cfg = _plan(name), CONFIGS[name]
    args = _megatron_args(plan)
    assert megatron_violations(args) == []
    assert (args.tp, args.pp, args.micro_batch, args.global_batch) == (
        cfg.tp, cfg.pp, cfg.micro_batch, cfg.global_batch)
    dp = cfg.world_size // (args.tp * args.pp)
    assert args.global_batch // (args.micro_batch * dp) == cfg.num_microbatches
    if cfg.virtual_stages > 1:  # Megatron's virtual pipeline size is the plan's chunks a rank
        per_chunk = args.layers_per_virtual
        assert PROFILE.num_blocks // cfg.pp // per_chunk == cfg.virtual_stages


# --------------------------------------------------------------------------------- DeepSpeed
DEEPSPEED_PLANS = [n for n in sorted(CONFIGS) if (n, "deepspeed") not in REFUSED]


@pytest.fixture(scope="module")
def deepspeed_read() -> dict[str, dict[str, Any]]:
    """What DeepSpeed's own DeepSpeedConfig reads from each export (one subprocess for all)."""
    _require("deepspeed")
    cases = []
    for name in DEEPSPEED_PLANS:
        cfg = CONFIGS[name]
        doc = json.loads(export_plan(_ds_plan(name), "deepspeed").text)
        cases.append({"config": doc, "pp": cfg.pp, "tp": cfg.tp, "dp": cfg.dp})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fixtures" / "deepspeed_load.py")],
        input=json.dumps(cases), capture_output=True, text=True, timeout=180, env=env,
        cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"zero_keys": result["zero_keys"], **dict(zip(DEEPSPEED_PLANS, result["read"],
                                                         strict=True))}


@pytest.mark.parametrize("name", DEEPSPEED_PLANS)
def test_deepspeed_config_loads_with_the_plans_topology(name, deepspeed_read):
    plan = _ds_plan(name)
    cfg, doc = CONFIGS[name], json.loads(export_plan(plan, "deepspeed").text)
    read = deepspeed_read[name]
    assert "error" not in read, read.get("error")
    assert read["world_size"] == cfg.dp  # the data-parallel size of the pp x tp x dp topology
    assert (read["train_batch_size"], read["micro_batch"], read["gradient_accumulation_steps"]) \
        == (cfg.global_batch, cfg.micro_batch, cfg.num_microbatches)
    assert read["zero_stage"] == cfg.zero
    assert (read["bf16"], read["fp16"]) == (cfg.dtype == "bf16", cfg.dtype == "fp16")
    assert read["autotp_size"] == (cfg.tp if cfg.tp > 1 else 0)
    full_pipe = cfg.pp > 1 and cfg.recompute == "full"
    assert read["activation_checkpoint_interval"] == (1 if full_pipe else 0)
    fw = get_framework(plan.framework)  # its checkpoints as the prediction kept them
    assert read["partition_activations"] == (cfg.recompute != "none" and fw.checkpoint_partitioned)
    assert read["cpu_checkpointing"] == (cfg.recompute != "none" and fw.checkpoint_offloaded)
    assert deepspeed_unknown_keys(doc) == []


def test_encoded_deepspeed_zero_keys_are_deepspeeds_own(deepspeed_read):
    from autopar.export_rules import DEEPSPEED_KEYS

    assert set(DEEPSPEED_KEYS["zero_optimization"]) <= set(deepspeed_read["zero_keys"])


# ------------------------------------------------------------------------------------ slurm
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_slurm_script_parses_and_launches_the_plans_world(name):
    cfg = CONFIGS[name]
    text = export_plan(_plan(name), "slurm").text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True, timeout=30)
    assert "#SBATCH --nodes=1\n" in text and "#SBATCH --gpus-per-node=8\n" in text
    assert "--nproc-per-node 8" in text and cfg.world_size == 8
