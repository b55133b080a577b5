"""What the exported-to tools accept, encoded from their own sources (pure; no tool imported).

Megatron-LM: the ``validate_args`` rules (``megatron/training/arguments.py``) and the config
checks they lead to (``megatron/core/model_parallel_config.py``,
``megatron/core/transformer/transformer_config.py``,
``megatron/core/num_microbatches_calculator.py``) that concern the flags autopar's megatron
export writes, read at NVIDIA/Megatron-LM commit d98e8a64ddf34856e74b24714e3bedb2f5a39553
(``core_v0.15.0rc7-2333``). ``megatron_violations`` returns each broken rule with its fix.

DeepSpeed: the config keys ``DeepSpeedConfig`` reads for the sections autopar writes, read at
microsoft/DeepSpeed commit 38327e07f6cd39b63418f60cedd1651b0be3e7c3 (v0.16.4+6):
``deepspeed/runtime/config.py`` (``get_pipeline_config`` defaults), ``runtime/constants.py``,
``runtime/zero/config.py``, ``runtime/activation_checkpointing/config.py`` and
``runtime/tensor_parallel/config.py`` (``TPTrainingConfig``). The ``pipeline`` keys ``stages``
and ``partition`` are parsed but no engine reads them (``PipelineModule(num_stages=...,
partition_method=...)`` does), so autopar does not write them.

torchtitan: the export targets v0.2.2 (commit 73a0e6979dd10b6b1904098eb3c8f62c18ab87ce,
``torchtitan/config/job_config.py``, ``torchtitan/train.py``): gradient accumulation has no key;
``train.py`` derives it as ``global_batch_size // (local_batch_size * dp)``, and with pp > 1
``local_batch_size`` is split into ``pipeline_parallel_microbatch_size`` micro-batches. Stages
are given as ``parallelism.module_fqns_per_model_part`` (``distributed/pipeline_parallel.py``; the
release has no split-points key). The tests load the export with that release's own
``ConfigManager`` and ``ParallelDims``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEEPSPEED_COMMIT",
    "DEEPSPEED_KEYS",
    "MEGATRON_COMMIT",
    "TORCHTITAN_COMMIT",
    "TORCHTITAN_RELEASE",
    "MegatronArgs",
    "deepspeed_unknown_keys",
    "megatron_violations",
]

MEGATRON_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
DEEPSPEED_COMMIT = "38327e07f6cd39b63418f60cedd1651b0be3e7c3"
TORCHTITAN_RELEASE = "v0.2.2"
TORCHTITAN_COMMIT = "73a0e6979dd10b6b1904098eb3c8f62c18ab87ce"


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronArgs:
    """The Megatron arguments autopar's export sets, with the plan's world size and blocks.

    ``first_layers`` / ``last_layers`` are ``--decoder-first/last-pipeline-num-layers``;
    ``layers_per_virtual`` is ``--num-layers-per-virtual-pipeline-stage``; ``virtual_per_rank``
    is ``--num-virtual-stages-per-pipeline-rank``; ``layout`` is
    ``--pipeline-model-parallel-layout`` (stages split by "|", E embedding, t a block, L loss).
    """

    world_size: int
    num_layers: int
    tp: int
    pp: int
    micro_batch: int
    global_batch: int
    sequence_parallel: bool = False
    layers_per_virtual: int | None = None
    virtual_per_rank: int | None = None
    first_layers: int | None = None
    last_layers: int | None = None
    layout: str | None = None
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    distributed_optimizer: bool = False
    torch_fsdp2: bool = False
    gradient_accumulation_fusion: bool = True  # Megatron's default
    untie_embeddings: bool = False
    fp16: bool = False
    bf16: bool = False
    num_experts: int | None = None
    ep: int = 1
    cp: int = 1
    seq_length: int | None = None
    fp8: bool = False
    grad_reduce_in_bf16: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_instances: int = 1


def _vpp(a: MegatronArgs) -> int | None:
    """Megatron's virtual_pipeline_model_parallel_size (None for 1), as validate_args sets it."""
    if a.layout is not None:
        vpp = (a.layout.count("|") + 1) // max(a.pp, 1)
    elif a.virtual_per_rank is not None:
        vpp = a.virtual_per_rank
    elif a.layers_per_virtual is not None and a.pp > 0 and a.num_layers % a.pp == 0:
        vpp = a.num_layers // a.pp // a.layers_per_virtual
    else:
        vpp = None
    return None if vpp == 1 else vpp


def _parallel_rules(a: MegatronArgs) -> list[str]:
    out = []
    model = a.tp * a.pp * a.cp
    if a.world_size % model:
        out.append(f"world size {a.world_size} is not divisible by tp*pp*cp = {model} "
                   "(arguments.py: 'world size is not divisible by total_model_size')")
        return out
    dp = a.world_size // model
    out += _dimension_rules(a, dp)
    if a.global_batch % (a.micro_batch * dp):
        out.append(f"--global-batch-size {a.global_batch} is not divisible by "
                   f"--micro-batch-size {a.micro_batch} x data-parallel size {dp} "
                   "(num_microbatches_calculator.py); pick a multiple of "
                   f"{a.micro_batch * dp}")
    if a.sequence_parallel and a.tp <= 1:
        out.append("--sequence-parallel needs --tensor-model-parallel-size > 1 "
                   "(validate_args turns it off); drop --sequence-parallel")
    if a.fp16 and a.bf16:
        out.append("--fp16 and --bf16 are exclusive; keep one")
    if a.grad_reduce_in_bf16 and not a.bf16:
        out.append("--grad-reduce-in-bf16 acts with --bf16 only (validate_args reads it in the "
                   "bf16 branch); drop it")
    return out


def _dimension_rules(a: MegatronArgs, dp: int) -> list[str]:
    """Context parallelism, fp8, optimizer offload and optimizer instances (arguments.py)."""
    out = []
    if a.cp > 1 and a.seq_length is not None and a.seq_length % (2 * a.cp):
        out.append(f"--seq-length {a.seq_length} is not a multiple of 2 * "
                   f"--context-parallel-size = {2 * a.cp} (validate_args)")
    if a.fp8 and not a.bf16:
        out.append("--fp8-format runs with --bf16 (Transformer Engine's fp8 linears, bf16 "
                   "elsewhere)")
    if a.optimizer_cpu_offload and not a.distributed_optimizer:
        out.append("--optimizer-cpu-offload needs --use-distributed-optimizer (zero 1)")
    if a.optimizer_instances > 1 and (not a.distributed_optimizer
                                      or (dp * a.cp) % a.optimizer_instances):
        out.append(f"--num-distributed-optimizer-instances {a.optimizer_instances} needs "
                   f"--use-distributed-optimizer and to divide the data-parallel size {dp * a.cp}")
    return out


def _layout_rules(a: MegatronArgs) -> list[str]:
    """arguments.py and pipeline_parallel_layer_layout.py on --pipeline-model-parallel-layout
    (with "t*n" unrolled as Megatron's parser does)."""
    out = []
    if (a.layers_per_virtual, a.virtual_per_rank, a.first_layers, a.last_layers) != (None,) * 4:
        out.append("--pipeline-model-parallel-layout excludes --num-layers-per-virtual-pipeline-"
                   "stage, --num-virtual-stages-per-pipeline-rank and --decoder-first/last-"
                   "pipeline-num-layers")
    stages = [re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), x)
              for x in (a.layout or "").split("|")]
    if len(stages) % max(a.pp, 1):
        out.append(f"the layout's {len(stages)} stages are not divisible by pp={a.pp}")
    flat = "".join(stages)
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") + flat.count(
            "L") != 2 or set(flat) - set("EtL"):
        out.append("the layout needs E first, L last, once each, and t for the blocks")
    if flat.count("t") != a.num_layers:
        out.append(f"the layout holds {flat.count('t')} blocks, not --num-layers {a.num_layers}")
    return out


def _pipeline_rules(a: MegatronArgs) -> list[str]:
    if a.layout is not None:
        return _layout_rules(a)
    out = []
    if a.layers_per_virtual is not None and a.virtual_per_rank is not None:
        out.append("--num-layers-per-virtual-pipeline-stage and "
                   "--num-virtual-stages-per-pipeline-rank are exclusive; keep one")
    uneven = a.first_layers is not None or a.last_layers is not None
    if a.layers_per_virtual is not None:
        if uneven:
            out.append("--num-layers-per-virtual-pipeline-stage cannot be used with "
                       "--decoder-first/last-pipeline-num-layers; use "
                       "--num-virtual-stages-per-pipeline-rank")
        elif a.num_layers % a.pp:
            out.append(f"{a.num_layers} layers are not divisible by pp={a.pp}")
        elif (a.num_layers // a.pp) % a.layers_per_virtual:
            out.append(f"{a.num_layers // a.pp} layers per pipeline stage are not divisible by "
                       f"--num-layers-per-virtual-pipeline-stage {a.layers_per_virtual}")
    elif not uneven and a.num_layers % a.pp:
        out.append(f"{a.num_layers} layers are not divisible by pp={a.pp}; set "
                   "--decoder-first/last-pipeline-num-layers")
    vpp = _vpp(a)
    if vpp is not None and a.pp <= 1:
        out.append("the interleaved schedule needs --pipeline-model-parallel-size > 1")
    if uneven:
        out += _uneven_rules(a, vpp)
    return out


def _uneven_rules(a: MegatronArgs, vpp: int | None) -> list[str]:
    """transformer_config.py's uneven-pipeline checks."""
    out = []
    middle_layers, middle_stages = a.num_layers, a.pp
    for name, n in (("first", a.first_layers), ("last", a.last_layers)):
        if n is None:
            continue
        if n <= 0:
            out.append(f"--decoder-{name}-pipeline-num-layers must be > 0")
        if vpp is not None and n % vpp:
            out.append(f"--decoder-{name}-pipeline-num-layers {n} is not divisible by the "
                       f"virtual pipeline size {vpp}")
        middle_layers -= n
        middle_stages -= 1
    if bool(middle_layers) != bool(middle_stages) or middle_layers < 0:
        out.append(f"{middle_layers} middle layers for {middle_stages} middle pipeline stages")
    elif middle_stages and middle_layers % middle_stages:
        out.append(f"{middle_layers} middle layers are not divisible by the "
                   f"{middle_stages} middle pipeline stages")
    elif middle_stages and vpp is not None and (middle_layers // middle_stages) % vpp:
        out.append(f"{middle_layers // middle_stages} layers per middle stage are not "
                   f"divisible by the virtual pipeline size {vpp}")
    return out


def _recompute_rules(a: MegatronArgs) -> list[str]:
    out = []
    gran, method = a.recompute_granularity, a.recompute_method
    if gran not in (None, "full", "selective"):
        out.append(f"--recompute-granularity {gran!r} is not 'full' or 'selective'")
    if method not in (None, "uniform", "block"):
        out.append(f"--recompute-method {method!r} is not 'uniform' or 'block'")
    if gran == "selective" and method is not None:
        out.append("--recompute-method is not supported with selective granularity; drop it")
    if gran == "selective" and a.recompute_num_layers is not None:
        out.append("--recompute-num-layers must be unset with selective granularity")
    if gran == "full":
        per_rank = a.num_layers // max(a.pp, 1)
        if method is None:
            out.append("full recompute needs --recompute-method uniform|block")
        most = max(per_rank, 1) if method == "uniform" else a.num_layers  # block: each stage's
        if a.recompute_num_layers is None or not 1 <= a.recompute_num_layers <= most:
            out.append(f"full recompute needs --recompute-num-layers between 1 and {most}")
    return out


def _fsdp2_rules(a: MegatronArgs) -> list[str]:
    if not a.torch_fsdp2:
        return []
    out = []
    if a.pp != 1:
        out.append("--use-torch-fsdp2 is not supported with pipeline parallelism (pp must be 1)")
    if a.distributed_optimizer:
        out.append("--use-torch-fsdp2 is not supported with --use-distributed-optimizer")
    if a.gradient_accumulation_fusion:
        out.append("--use-torch-fsdp2 needs --no-gradient-accumulation-fusion")
    if not a.untie_embeddings:
        out.append("--use-torch-fsdp2 needs --untie-embeddings-and-output-weights (a model "
                   "whose output layer does not share the embedding's weights)")
    if a.fp16:
        out.append("--use-torch-fsdp2 is not supported with --fp16; use --bf16")
    return out


def _moe_rules(a: MegatronArgs) -> list[str]:
    """validate_args' MoE and expert-parallel checks."""
    out = []
    if a.num_experts is not None and a.tp > 1 and not a.sequence_parallel:
        out.append("a MoE model with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                   "(arguments.py: 'When using MoE and tensor parallelism, sequence parallelism "
                   "must be used'); plan with sequence_parallel=True")
    if a.ep > 1:
        if a.num_experts is None:
            out.append("--expert-model-parallel-size > 1 needs --num-experts")
        elif a.num_experts % a.ep:
            out.append(f"--num-experts {a.num_experts} is not a multiple of "
                       f"--expert-model-parallel-size {a.ep}")
    return out


def megatron_violations(args: MegatronArgs) -> list[str]:
    """Every Megatron-LM rule ``args`` breaks (empty when validate_args accepts them)."""
    return (_parallel_rules(args) + _pipeline_rules(args) + _recompute_rules(args)
            + _fsdp2_rules(args) + _moe_rules(args))


# DeepSpeedConfig: section -> the keys it reads there (None: a top-level scalar).
DEEPSPEED_KEYS: dict[str, frozenset[str] | None] = {
    "train_batch_size": None,
    "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None,
    "gradient_clipping": None,
    "steps_per_print": None,
    "zero_optimization": frozenset({
        "stage", "overlap_comm", "contiguous_gradients", "reduce_scatter",
        "reduce_bucket_size", "allgather_partitions", "allgather_bucket_size",
        "offload_param", "offload_optimizer", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_max_live_parameters",
        "stage3_max_reuse_distance", "sub_group_size"}),
    "bf16": frozenset({"enabled", "immediate_grad_update", "check_grad_overflow"}),
    "fp16": frozenset({"enabled", "auto_cast", "loss_scale", "initial_scale_power",
                       "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                       "min_loss_scale"}),
    # get_pipeline_config's defaults; the pipe engine reads the last four ("use_reentrant" too).
    "pipeline": frozenset({"stages", "partition", "seed_layers", "activation_checkpoint_interval",
                           "pipe_partitioned", "grad_partitioned", "use_reentrant"}),
    "activation_checkpointing": frozenset({
        "partition_activations", "number_checkpoints", "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary", "profile", "cpu_checkpointing"}),
    "tensor_parallel": frozenset({"autotp_size", "dtype", "tp", "tensor_parallel",
                                  "injection_policy_tuple", "keep_module_on_host",
                                  "replace_with_kernel_inject", "kernel_inject"}),
}
# Keys DeepSpeed parses but no engine acts on (PipelineModule's constructor takes them).
DEEPSPEED_UNUSED = {("pipeline", "stages"), ("pipeline", "partition")}


def deepspeed_unknown_keys(doc: dict[str, Any]) -> list[str]:
    """Keys of ``doc`` DeepSpeed's config parser does not read (or parses and ignores)."""
    out = []
    for key, value in doc.items():
        if key not in DEEPSPEED_KEYS:
            out.append(key)
            continue
        known = DEEPSPEED_KEYS[key]
        if known is None:
            continue
        for sub in value:
            if sub not in known or (key, sub) in DEEPSPEED_UNUSED:
                out.append(f"{key}.{sub}")
    return out
