"""Write a Plan in other tools' formats: torchtitan TOML, Megatron-LM flags, DeepSpeed JSON, slurm.

Each exporter is a pure function ``Plan -> Export`` (the document text, plus notes about what the
target tool cannot express, which the CLI prints on stderr; Megatron-LM's lives in
export_megatron.py). Mappings of autopar's knobs:

- ``zero`` 0: replicated data parallel (torchtitan ``data_parallel_replicate_degree``; DDP);
  1 and 2: FSDP2 keeping parameters unsharded between forward and backward (torchtitan shard
  degree with ``fsdp_reshard_after_forward = "never"``; Megatron's distributed optimizer;
  DeepSpeed ZeRO stage 1/2); 3: FSDP2 ``fully_shard`` (``"always"``; DeepSpeed stage 3).
- ``recompute``: none / selective (the attention core) / full (each layer's input only).

A plan is data anyone can write: every string it carries (``model``, stage names) is quoted for
the language it lands in (``shlex.quote`` for shell, ``toml_string`` for TOML) or, in comments,
escaped onto one line (``one_line``), so no plan field can add a line or a command.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Callable
from typing import Any

from autopar.config import TORCH_DTYPE_NAMES
from autopar.cost_model.framework_support import moe_support
from autopar.cost_model.frameworks import FRAMEWORKS, framework_supports, get_framework
from autopar.export_base import (
    Export,
    block_mode,
    header,
    plan_recompute,
    plan_split_method,
    recompute_refusal_for,
    seq_len,
    split_refusal_for,
)
from autopar.export_megatron import to_megatron
from autopar.export_rules import (
    DEEPSPEED_COMMIT,
    TORCHTITAN_COMMIT,
    TORCHTITAN_RELEASE,
    deepspeed_unknown_keys,
)
from autopar.plan import Plan
from autopar.schedules import SCHEDULES
from autopar.toml_text import one_line, toml_document, toml_string

__all__ = [
    "EXPORTERS",
    "TORCHTITAN_SCHEDULES",
    "Export",
    "export_plan",
    "export_refusal",
    "one_line",
    "to_deepspeed",
    "to_megatron",
    "to_slurm",
    "to_torchtitan",
    "toml_string",
]

# autopar schedule name -> torchtitan's `pipeline_parallel_schedule` (``Schedule.torchtitan_name``).
TORCHTITAN_SCHEDULES: dict[str, str] = {n: s.torchtitan_name for n, s in SCHEDULES.items()}
RDZV_PORT = 29500  # torchrun's default rendezvous port


# autopar profile layer -> the torchtitan module FQNs it covers (torchtitan's Llama 3 model:
# ``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``; sourced: torchtitan v0.2.2
# ``distributed/pipeline_parallel.py`` ``generate_llm_fqn_per_model_part``). Zoo layer names are
# module names but "embedding" and "head" (final norm, output projection; docs/model-structure.md).
_TORCHTITAN_FQNS = {"embedding": ("tok_embeddings",), "head": ("norm", "output")}


def _module_fqns_per_model_part(plan: Plan) -> list[list[str]] | None:
    """torchtitan's ``module_fqns_per_model_part``: each stage's module FQNs, in stage order
    (None when a stage holds a layer that is not an embedding, a block or the head)."""
    parts = []
    for stage in plan.stages:
        names: list[str] = []
        for layer in stage.layer_names:
            if layer in _TORCHTITAN_FQNS:
                names += _TORCHTITAN_FQNS[layer]
            elif layer.startswith("layers.") and layer[len("layers."):].isdigit():
                names.append(layer)
            else:
                return None
        parts.append(names)
    return parts


def _titan_recompute(plan: Plan) -> dict[str, str]:
    """torchtitan's ``[activation_checkpoint]``: one mode for every block, or full recompute
    of every n-th block (``mode = "selective"``, ``selective_ac_option = "n"``)."""
    pattern = plan_recompute(plan, "torchtitan")
    if pattern is not None and pattern[0] == "every-nth":
        return {"mode": "selective", "selective_ac_option": str(pattern[1])}
    return {"mode": block_mode(plan), "selective_ac_option": "op"}


def to_torchtitan(plan: Plan) -> Export:
    """torchtitan job TOML: ``[parallelism]``, ``[activation_checkpoint]``, ``[training]``.

    pp > 1: ``module_fqns_per_model_part`` lists every stage's modules (the plan's own split;
    torchtitan runs stage ``i`` on pipeline rank ``i % pp``, V-shaped for ZBV and DualPipeV, as
    autopar places them).
    """
    cfg = plan.config
    notes: list[str] = []
    parallelism = _titan_parallelism(plan, notes)
    if cfg.tp > 1 and not cfg.sequence_parallel:
        notes.append("torchtitan always runs sequence parallelism with tp > 1")
    tables = {
        "job": {"description": header(plan)},
        "parallelism": parallelism,
        "activation_checkpoint": _titan_recompute(plan),
        "training": {
            # pp > 1: the local batch is split into pipeline micro-batches; pp = 1: one
            # micro-batch a forward, train.py accumulates global // (local * dp) of them.
            "local_batch_size": cfg.global_batch // cfg.dp if cfg.pp > 1 else cfg.micro_batch,
            "global_batch_size": cfg.global_batch,
            "seq_len": seq_len(plan),
            "mixed_precision_param": TORCH_DTYPE_NAMES["fp32" if cfg.dtype == "fp32" else "bf16"],
            "mixed_precision_reduce": "float32",
        },
    }
    if cfg.offload == "params":  # FSDP2 CPUOffloadPolicy: parameters, gradients, optimizer
        tables["training"]["enable_cpu_offload"] = True
    if plan.moe is not None and get_framework(plan.framework).moe_force_balance:
        tables["debug"] = {"moe_force_load_balance": True}  # setting moe-force-balance
    if cfg.dtype == "fp8":
        tables["model"] = {"converters": ["quantize.linear.float8"]}
        tables["quantize.linear.float8"] = {"recipe_name": "tensorwise",
                                            "filter_fqns": ["output"]}
        if get_framework(plan.framework).fp8_param_gather:  # what the prediction assumed
            tables["quantize.linear.float8"].update(
                enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True)
        # The fp8 speed the plan was costed at is torchao's under torch.compile: eager, its
        # amax and cast kernels make a block slower than bf16 (measured on an H200,
        # benchmarks/results/gpu_fp8_h200.md: 1.3-8x slower eager, 1.1-1.4x faster compiled).
        tables["compile"] = {"enable": True}
        notes.append("[compile] enable = true: torchao's fp8 linears are faster than bf16 only "
                     "under torch.compile (eager they are slower)")
    title = f"{header(plan)} (targets torchtitan {TORCHTITAN_RELEASE}, {TORCHTITAN_COMMIT})"
    return Export(text=toml_document(tables, title), notes=tuple(notes))


def _titan_parallelism(plan: Plan, notes: list[str]) -> dict[str, Any]:
    """torchtitan's ``[parallelism]`` table of the plan (what it cannot express goes to notes)."""
    cfg = plan.config
    sharded = cfg.zero > 0 and cfg.data_ranks > 1
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": cfg.dp_replicate if sharded else cfg.dp,
        "data_parallel_shard_degree": cfg.dp_shard if sharded else 1,
        "fsdp_reshard_after_forward": "always" if cfg.zero == 3 else "never",
        "tensor_parallel_degree": cfg.tp,
        "enable_async_tensor_parallel": False,
        "pipeline_parallel_degree": cfg.pp,
        "pipeline_parallel_schedule": TORCHTITAN_SCHEDULES[cfg.schedule],
        "pipeline_parallel_microbatch_size": cfg.micro_batch,
        "context_parallel_degree": cfg.cp,
    }
    if cfg.ep > 1:  # torchtitan's "partial dp -> ep" (etp = tp), or with the experts folded
        # over tp (setting expert-tp-1) its "partial dp + all tp -> ep" (etp = 1)
        fw = get_framework(plan.framework)
        parallelism.update(expert_parallel_degree=cfg.ep,
                           expert_tensor_parallel_degree=1 if fw.expert_tp_folded else cfg.tp)
        if fw.ep_dispatch == "hierarchical":  # setting ep-deepep
            parallelism["expert_parallel_comm_backend"] = "deepep"
    if cfg.cp > 1:  # how the prediction exchanged K/V: the ring, or torchtitan's all-gather
        ring = get_framework(plan.framework).cp_comm == "ring"
        parallelism["context_parallel_rotate_method"] = "alltoall" if ring else "allgather"
        if cfg.zero == 0:
            notes.append("torchtitan shards parameters (FSDP) over dp_shard * cp whenever cp > 1; "
                         "the plan's zero=0 runs as FSDP there")
    if cfg.pp > 1:
        parts = _module_fqns_per_model_part(plan)
        if parts is not None:
            parallelism["module_fqns_per_model_part"] = parts
        else:
            names = [list(s.layer_names) for s in plan.stages]
            notes.append(f"stages {names} are not all embedding, blocks and head; set "
                         "module_fqns_per_model_part by hand")
    return parallelism


def _deepspeed_pipeline(plan: Plan, doc: dict[str, Any]) -> list[str]:
    """The notes building a DeepSpeed PipelineModule for the plan's stages (its pipeline
    section set in ``doc``)."""
    cfg, notes = plan.config, []
    # PipelineModule takes the stage count and partition from its constructor (DeepSpeed
    # parses but never reads pipeline.stages / .partition); its topology must name the tp
    # ranks, or num_stages alone counts them as data parallel and the batch check fails.
    method = plan_split_method(plan, "deepspeed")
    if method is None:  # export_plan refuses it first (export_refusal)
        raise ValueError(split_refusal_for(plan, "deepspeed"))
    # Megatron-DeepSpeed's GPTModelPipe adds weightless layers of its own (the final norm,
    # lambdas) at the ends: the same blocks per stage there are --pp-partition-method
    # 'type:transformer|embedding' (BLOOM's; the tied embedding at both ends weighs one
    # layer each) or its default 'type:transformer' (megatron/model/gpt_model.py)
    megatron_ds = ("type:transformer|embedding' (embeddings tied at both ends)"
                   if method == "uniform" else "type:transformer'")
    method = "type:<your block's class name>" if method == "type:<block>" else method
    notes.append(
        "build the PipelineModule from one layer per profile layer (the embedding, each "
        "block, the head), with topology=PipeModelDataParallelTopology("
        f"num_pp={cfg.pp}, num_mp={cfg.tp}, num_dp={cfg.dp}) and "
        f"partition_method='{method}' (stage bounds "
        f"{[list(s.layers) for s in plan.stages]} in profile layers); in "
        f"Megatron-DeepSpeed: --pp-partition-method '{megatron_ds}"
    )
    if block_mode(plan) == "full":  # the pipe engine checkpoints every interval layers
        doc["pipeline"] = {"activation_checkpoint_interval": 1}
        notes.append("build the PipelineModule with checkpointable_layers=['<your "
                     "block's class name>'] so that the pipe engine checkpoints the blocks "
                     "only, as costed (without it every layer with parameters is; "
                     "Megatron-DeepSpeed's GPTModelPipe checkpoints its transformer "
                     "layers only)")
    return notes


def to_deepspeed(plan: Plan) -> Export:
    """DeepSpeed config JSON (batch sizes, ZeRO stage, precision, pipeline, tensor parallel)."""
    cfg = plan.config
    notes = []
    if plan.moe is not None:
        # DeepSpeed sets the expert-parallel degree in model code; its JSON has no key for it.
        notes.append("the model is a mixture of experts: build its MoE layers with "
                     f"deepspeed.moe.layer.MoE(num_experts={plan.moe.experts}, "
                     f"ep_size={cfg.ep}, k={plan.moe.top_k})"
                     + (", and give the optimizer the parameter groups of deepspeed.moe.utils."
                        "split_params_into_different_moe_groups_for_optimizer (the experts' "
                        "own data-parallel groups)" if cfg.ep > 1 else ""))
    doc: dict[str, Any] = {
        "train_batch_size": cfg.global_batch,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.num_microbatches,
        "zero_optimization": {
            "stage": cfg.zero,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "bf16": {"enabled": cfg.dtype == "bf16"},
        "fp16": {"enabled": cfg.dtype == "fp16"},
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
    }
    if cfg.pp > 1:
        notes += _deepspeed_pipeline(plan, doc)
    if cfg.tp > 1:
        doc["tensor_parallel"] = {"autotp_size": cfg.tp}
    if cfg.offload != "none":  # ZeRO-Offload / ZeRO-Infinity to CPU memory
        doc["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if cfg.offload == "params":
        doc["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if block_mode(plan) != "none":  # as the prediction assumed (checkpoints.py)
        fw = get_framework(plan.framework)
        doc["activation_checkpointing"] = {
            "partition_activations": fw.checkpoint_partitioned,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": fw.checkpoint_offloaded,
        }
        if block_mode(plan) == "selective":
            notes.append("DeepSpeed checkpoints whole layers; selective recompute needs the model")
        elif cfg.pp == 1:
            notes.append("full recompute: wrap each block in deepspeed.checkpointing.checkpoint "
                         "(the activation_checkpointing section configures it)")
    unknown = deepspeed_unknown_keys(doc)
    if unknown:  # a bug in this exporter, not in the plan
        raise AssertionError(f"DeepSpeed ({DEEPSPEED_COMMIT[:12]}) does not read {unknown}")
    return Export(text=json.dumps(doc, indent=2) + "\n", notes=tuple(notes))


def cluster_shape(plan: Plan) -> tuple[int, int]:
    """``(nodes, gpus_per_node)`` of the plan's cluster (8 a node when the plan does not say)."""
    cluster = plan.cluster or {}
    per_node = int(cluster.get("gpus_per_node") or 8)
    world = plan.config.world_size
    nodes = int(cluster.get("nodes") or max(1, -(-world // per_node)))
    return nodes, min(per_node, world)


def to_slurm(plan: Plan, *, plan_path: str = "plan.json", steps: int = 100) -> Export:
    """An sbatch script: ``autopar run`` on every node (srun, one task a node).

    ``autopar run`` starts torchrun on its node; the nodes meet at a c10d rendezvous on the
    first node of the allocation. Values reach the per-node shell through the environment, so
    paths with spaces or quotes need no nested quoting.
    """
    nodes, per_node = cluster_shape(plan)
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in (plan.model or "autopar"))
    # A model file is code: `autopar run` runs it only when named (--model), never from the
    # plan's own field, so the script names it, where the user reads it before running.
    model_file = plan.model.endswith(".py")
    model_env = f"export AUTOPAR_MODEL={shlex.quote(plan.model)}\n" if model_file else ""
    model_flag = '  --model "$AUTOPAR_MODEL" \\\n' if model_file else ""
    notes = ((f"the script runs the model file {plan.model} on every node (--model); check it "
              "is the file the plan was made for",) if model_file else ())
    text = f"""#!/bin/bash
# {one_line(header(plan))}
#SBATCH --job-name=autopar-{name[:32]}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --exclusive
set -euo pipefail

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export AUTOPAR_PLAN={shlex.quote(plan_path)}
{model_env}export AUTOPAR_RDZV_ENDPOINT="$head_node:{RDZV_PORT}"
export OMP_NUM_THREADS=1

# One task a node; each runs torchrun with {per_node} workers (through `autopar run`).
srun --nodes={nodes} --ntasks-per-node=1 bash -c 'exec autopar run "$AUTOPAR_PLAN" \\
{model_flag}  --steps {steps} \\
  --nnodes {nodes} \\
  --node-rank "$SLURM_NODEID" \\
  --nproc-per-node {per_node} \\
  --rdzv-endpoint "$AUTOPAR_RDZV_ENDPOINT"'
"""
    return Export(text=text, notes=notes)


EXPORTERS: dict[str, Callable[..., Export]] = {
    "torchtitan": to_torchtitan,
    "megatron": to_megatron,
    "deepspeed": to_deepspeed,
    "slurm": to_slurm,
}


def export_plan(plan: Plan, to: str, **options: Any) -> Export:
    """Export ``plan`` in the format ``to`` (a key of ``EXPORTERS``).

    Args:
        plan: the plan.
        to: torchtitan | megatron | deepspeed | slurm.
        **options: exporter options (slurm: ``plan_path``, ``steps``).

    Raises:
        ValueError: an unknown format, or a plan the target tool cannot run (its framework's
            ``framework_supports`` names why).
    """
    if to not in EXPORTERS:
        raise ValueError(f"unknown export format {to!r}; use one of {', '.join(EXPORTERS)}")
    refusal = export_refusal(plan, to)
    if refusal:
        raise ValueError(refusal)
    result = EXPORTERS[to](plan, **options)
    target, planned = EXPORT_FRAMEWORK[to], plan.framework.split("+")[0]
    if target == planned:
        return result
    return dataclasses.replace(result, notes=(*result.notes, (
        f"the plan's estimate is {planned}'s; {target} runs this split with its own memory and "
        f"step time: `autopar estimate ... --framework {target}` predicts them, and `autopar "
        f"plan ... --framework {target}` may choose another split")))


# Export format -> the framework that runs what it writes (its record's ``exports``; slurm
# launches `autopar run`).
EXPORT_FRAMEWORK = {fmt: name for name in FRAMEWORKS for fmt in get_framework(name).exports}


def export_refusal(plan: Plan, to: str) -> str | None:
    """Why the tool behind format ``to`` cannot run ``plan`` (None when it can)."""
    target = EXPORT_FRAMEWORK[to]
    framework = get_framework(target)
    moe = plan.moe
    reason = framework_supports(framework, plan.config) or moe_support(
        framework, plan.config, moe, moe.ep_blocker if moe else "") or recompute_refusal_for(
        plan, target) or split_refusal_for(plan, target)
    if reason is None:
        return None
    return (f"cannot export a plan made for {plan.framework} to {to}: {reason}; re-plan for it "
            f"with `autopar plan ... --framework {target}`")
