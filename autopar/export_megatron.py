"""Megatron-LM ``pretrain_gpt.py`` flags for a Plan, checked against Megatron-LM's own
``validate_args`` rules (``export_rules``): the parallel degrees, the pipeline schedule and its
chunk sizes, recompute, the distributed optimizer or FSDP, mixture-of-experts flags with the
token dispatcher the prediction assumed, the precision with its fp8 recipe and gradient dtype,
and the framework settings the plan's prediction assumed (``megatron-lm+...``), as flags or,
where the setting is not a flag, as a note.
"""

from __future__ import annotations

import shlex
from typing import Any

from autopar.cost_model.frameworks import get_framework
from autopar.export_base import Export, block_mode, blocks_per_stage, plan_recompute, seq_len
from autopar.export_rules import MEGATRON_COMMIT, MegatronArgs, megatron_violations
from autopar.plan import Plan

__all__ = ["to_megatron"]


def _megatron_pipeline(plan: Plan, notes: list[str]) -> dict[str, Any]:
    """The pipeline layout flags (flag -> value) that set the plan's own stages: none for an
    even split, the chunk size for even interleaved chunks, the first and last stage's blocks
    when the middle ones are even, else ``--pipeline-model-parallel-layout`` stage by stage."""
    cfg = plan.config
    blocks = blocks_per_stage(plan)
    total = sum(blocks)
    if cfg.pp == 1:
        return {}
    if cfg.schedule not in ("1f1b", "interleaved-1f1b"):
        notes.append(f"Megatron has no {cfg.schedule}; exported as "
                     f"{'interleaved 1F1B' if cfg.virtual_stages > 1 else '1F1B'}")
    if len(set(blocks)) == 1:
        if cfg.virtual_stages == 1:
            return {}
        return {"--num-layers-per-virtual-pipeline-stage": total // len(blocks)}
    if cfg.virtual_stages == 1:
        uneven = {"--decoder-first-pipeline-num-layers": blocks[0],
                  "--decoder-last-pipeline-num-layers": blocks[-1]}
        if not megatron_violations(_megatron_args(plan, uneven, {})):
            return uneven
    return {"--pipeline-model-parallel-layout": _layout(blocks)}


def _layout(blocks: list[int]) -> str:
    """Megatron's layout string of stages holding ``blocks`` blocks each, in stage order (E the
    embedding on the first, L the loss on the last)."""
    last = len(blocks) - 1
    return "|".join(("E" if j == 0 else "") + (f"t*{n}" if n else "") + ("L" if j == last else "")
                    for j, n in enumerate(blocks))


def _megatron_args(plan: Plan, pipeline: dict[str, Any], extra: dict[str, Any]) -> MegatronArgs:
    """The MegatronArgs the exported flags set (``extra``: MegatronArgs fields)."""
    cfg = plan.config
    return MegatronArgs(
        world_size=cfg.world_size, num_layers=sum(blocks_per_stage(plan)), tp=cfg.tp,
        pp=cfg.pp, micro_batch=cfg.micro_batch, global_batch=cfg.global_batch,
        layers_per_virtual=pipeline.get("--num-layers-per-virtual-pipeline-stage"),
        virtual_per_rank=pipeline.get("--num-virtual-stages-per-pipeline-rank"),
        first_layers=pipeline.get("--decoder-first-pipeline-num-layers"),
        last_layers=pipeline.get("--decoder-last-pipeline-num-layers"),
        layout=pipeline.get("--pipeline-model-parallel-layout"),
        bf16=cfg.dtype in ("bf16", "fp8"), fp16=cfg.dtype == "fp16", cp=cfg.cp,
        seq_length=seq_len(plan), fp8=cfg.dtype == "fp8",
        grad_reduce_in_bf16=_grad_reduce_in_bf16(plan),
        num_experts=plan.moe.experts if plan.moe is not None else None, ep=cfg.ep, **extra)


def _megatron_options(plan: Plan, notes: list[str]) -> tuple[list[list[str]], dict[str, Any]]:
    """Sequence parallel, recompute, optimizer sharding: flags and the MegatronArgs they set."""
    cfg = plan.config
    flags: list[list[str]] = []
    extra: dict[str, Any] = {}
    if cfg.sequence_parallel and cfg.tp > 1:
        flags.append(["--sequence-parallel"])
        extra["sequence_parallel"] = True
    elif cfg.sequence_parallel:
        notes.append("Megatron turns sequence parallelism off at tp=1; --sequence-parallel dropped")
    pattern = plan_recompute(plan, "megatron-lm")
    first_n = pattern[1] if pattern is not None and pattern[0] == "first-n" else 0
    recompute = "full" if first_n else block_mode(plan)
    if recompute != "none":  # the first n blocks of each stage, or every block alike
        flags.append(["--recompute-granularity", recompute])
        extra["recompute_granularity"] = recompute
        if recompute == "full":
            method, n = ("block", first_n) if first_n else ("uniform", 1)
            flags += [["--recompute-method", method], ["--recompute-num-layers", str(n)]]
            extra.update(recompute_method=method, recompute_num_layers=n)
    fw = get_framework(plan.framework)
    if fw.name == "megatron-lm":  # the switches the plan's prediction assumed
        # --distribute-saved-activations is full recompute's option only.
        dropped = {"distribute-saved-activations"} if recompute != "full" else set()
        flags += [flag for setting in fw.settings if setting not in dropped
                  for flag in _MEGATRON_SETTING_FLAGS.get(setting, [["--" + setting]])]
        if dropped & set(fw.settings):
            notes.append("--distribute-saved-activations dropped: Megatron-LM takes it with "
                         "full recompute only, and the plan recomputes no block fully")
        if "expandable-segments" in fw.settings:
            notes.append("launch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the "
                         "plan's memory assumed it)")
    # the precision-aware optimizer (bf16-adam-moments) and --optimizer-cpu-offload run in the
    # distributed one only (on one data rank too, where the plan's zero shards nothing)
    if (cfg.zero in (1, 2) and cfg.data_ranks > 1) or (
            cfg.offload != "none" and cfg.data_ranks == 1) or "bf16-adam-moments" in fw.settings:
        flags.append(["--use-distributed-optimizer"])
        extra["distributed_optimizer"] = True
        if cfg.dp_replicate > 1:  # HSDP of the optimizer: instances, all-reduced across
            flags.append(["--num-distributed-optimizer-instances", str(cfg.dp_replicate)])
            extra["optimizer_instances"] = cfg.dp_replicate
    elif cfg.zero == 3 and cfg.data_ranks > 1:
        flags += [["--use-torch-fsdp2"], ["--no-gradient-accumulation-fusion"],
                  ["--untie-embeddings-and-output-weights"]]
        extra.update(torch_fsdp2=True, gradient_accumulation_fusion=False, untie_embeddings=True)
        notes.append("Megatron's --use-torch-fsdp2 needs --no-gradient-accumulation-fusion (added; "
                     "the weight-gradient GEMM no longer accumulates in place) and "
                     "--untie-embeddings-and-output-weights (added; a model that ties its output "
                     "layer to the embedding gains a vocab x hidden output matrix)")
    if cfg.offload == "optimizer":
        flags += [["--optimizer-cpu-offload"], ["--use-precision-aware-optimizer"]]
        extra["optimizer_cpu_offload"] = True
    return flags, extra


# Megatron-LM settings whose flags are not ``--<setting>`` (written with the MoE and fp8 flags).
_MEGATRON_SETTING_FLAGS = {"moe-force-balance": [["--moe-router-force-load-balancing"]],
                           "bf16-adam-moments": [["--use-precision-aware-optimizer"],
                                                 ["--exp-avg-dtype", "bf16"],
                                                 ["--exp-avg-sq-dtype", "bf16"]],
                           "ep-deepep": [], "fp8-tensorwise": [], "expandable-segments": [],
                           "expert-tp-1": []}


def _megatron_moe_flags(plan: Plan) -> list[list[str]]:
    """Megatron-Core MoE flags for a mixture-of-experts plan (none for a dense one), with the
    token dispatcher the prediction assumed (the flex dispatcher's DeepEP for ``ep-deepep``)
    and the experts' tensor parallelism (``--expert-tensor-parallel-size 1`` for
    ``expert-tp-1``; else Megatron-Core's default, the tp size)."""
    moe, cfg = plan.moe, plan.config
    if moe is None:
        return []
    flex = get_framework(plan.framework).ep_dispatch == "hierarchical"
    flags = [["--num-experts", str(moe.experts)], ["--moe-router-topk", str(moe.top_k)],
             ["--moe-ffn-hidden-size", str(moe.expert_hidden)],
             ["--expert-model-parallel-size", str(cfg.ep)],
             ["--moe-token-dispatcher-type", "flex" if flex else "alltoall"],
             *([["--moe-flex-dispatcher-backend", "deepep"]] if flex else []),
             ["--moe-grouped-gemm"]]
    if get_framework(plan.framework).expert_tp_folded:  # setting expert-tp-1
        flags.append(["--expert-tensor-parallel-size", "1"])
    if moe.shared_experts:
        flags.append(["--moe-shared-expert-intermediate-size",
                      str(moe.shared_experts * moe.expert_hidden)])
    if moe.capacity_factor > 0:
        flags.append(["--moe-expert-capacity-factor", f"{moe.capacity_factor:g}"])
    return flags


def _grad_reduce_in_bf16(plan: Plan) -> bool:
    """Whether the prediction kept bf16 gradients (a 2-byte main_grad buffer, reduced in bf16)
    where Megatron-LM's validate_args would accumulate and reduce them in fp32: a bf16 or fp8
    plan without the ``accumulate-allreduce-grads-in-fp32`` setting."""
    fw = get_framework(plan.framework)
    return plan.config.dtype in ("bf16", "fp8") and fw.grad_reduce_bytes == 2


def to_megatron(plan: Plan) -> Export:
    """Megatron-LM ``pretrain_gpt.py`` flags, one per line with shell continuations.

    The flags are checked against Megatron-LM's ``validate_args`` rules (``export_rules``,
    commit ``MEGATRON_COMMIT``); where Megatron has an equivalent the flags are rewritten (a
    note says so), otherwise the plan is refused.

    Raises:
        ValueError: the flags break a Megatron-LM rule (each rule and its fix named).
    """
    cfg = plan.config
    notes: list[str] = []
    pipeline = _megatron_pipeline(plan, notes)
    options, extra = _megatron_options(plan, notes)
    broken = megatron_violations(_megatron_args(plan, pipeline, extra))
    if broken:
        raise ValueError(f"Megatron-LM ({MEGATRON_COMMIT[:12]}) validate_args would reject "
                         f"this plan: {'; '.join(broken)}")
    flags: list[list[str]] = [
        ["--tensor-model-parallel-size", str(cfg.tp)],
        ["--pipeline-model-parallel-size", str(cfg.pp)],
        *([["--context-parallel-size", str(cfg.cp)]] if cfg.cp > 1 else []),
        ["--micro-batch-size", str(cfg.micro_batch)],
        ["--global-batch-size", str(cfg.global_batch)],
        ["--seq-length", str(seq_len(plan))],
    ]
    flags += [[flag, str(value)] for flag, value in pipeline.items()]
    flags += options
    flags += _megatron_moe_flags(plan)
    if cfg.dtype in ("bf16", "fp16"):
        flags.append([f"--{cfg.dtype}"])
    if cfg.dtype == "fp8":  # Transformer Engine fp8 linears, bf16 elsewhere, the costed recipe
        recipe = {"dynamic": "tensorwise"}.get(get_framework(plan.framework).fp8_scaling, "delayed")
        flags += [["--bf16"], ["--fp8-format", "hybrid"], ["--fp8-recipe", recipe]]
    if _grad_reduce_in_bf16(plan):
        flags.append(["--grad-reduce-in-bf16"])
        notes.append("--grad-reduce-in-bf16: gradients accumulate and reduce in bf16, as the "
                     "prediction costed them; for Megatron-LM's fp32 accumulation plan with "
                     f"--framework {plan.framework}+accumulate-allreduce-grads-in-fp32 (2 more "
                     "bytes a parameter, twice the gradient traffic)")
    lines = [" ".join(shlex.quote(part) for part in flag) for flag in flags]
    return Export(text=" \\\n".join(lines) + "\n", notes=tuple(notes))
