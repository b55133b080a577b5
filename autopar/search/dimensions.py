"""The search's choices of the dimensions beyond dp x tp x pp: cp, HSDP, offload, precision, and
the framework settings that are parallelism choices.

- cp: powers of two dividing the data/context ranks, at most ``max_cp``, with the sequence a
  multiple of 2 cp (load-balanced ring attention: two chunks per rank) and at least
  ``min_cp_tokens`` tokens per rank (options.py: 8,192, Llama 3's long-context layout), when
  the framework runs context parallelism. The bounds and the ILP decide, per candidate,
  whether the ring's traffic is worth the smaller per-rank sequence.
- dp_replicate (HSDP): 1, and the replica count whose shard group of dp_shard * cp * tp ranks
  fills exactly one node (the shard's all-gathers and reduce-scatters on NVLink, only the
  replicas' all-reduce across nodes), when the framework runs HSDP, at its fullest sharding
  (zero 3; zero 1 for Megatron-LM's distributed optimizer), where the per-micro-batch
  gathers make the shard group's link matter most.
- dtype: ``options.dtype``, or every dtype the GPU runs fast that the framework runs
  (``precision.supported_dtypes``). bf16 is costed beside fp8: fp8's casts can outweigh its
  faster matmuls at some shapes and not others (a small Llama on H100 under Megatron-LM: fp8
  faster at tp=4 with one sequence a micro-batch, 11% slower at dp=8 with four), and its
  shorter backward hides less data-parallel traffic, so no one shape shows bf16 cannot win.
- framework settings that are parallelism choices (``SEARCHED_SETTINGS``: Megatron-LM's
  ``expert-tp-1``, its experts folded over tp): the whole search runs once per combination
  for a model they apply to (``framework_variants``), and the faster plan wins; its framework
  spec names the settings, so the export writes their flags.
- offload: after the search, the offloaded variants (``offload_variants``: the settings the
  framework and ``options.offloads`` allow) of the candidates that could, memory aside, beat
  the k-th best plan (``planner._offload_worthy``), of every candidate when none fits. The cost
  model charges offload only extra time (copies, the CPU step), so a variant is no faster than
  its candidate's time bound with unlimited memory (``bounds.unlimited_memory_time_bound``);
  it wins where the freed memory lets a split fit at all, or with less recomputation.
"""

from __future__ import annotations

import dataclasses

from autopar.config import ParallelConfig
from autopar.cost_model.framework_settings import SEARCHED_SETTINGS
from autopar.cost_model.framework_support import folds_experts
from autopar.cost_model.frameworks import Framework, framework_supports, get_framework
from autopar.cost_model.hardware import Cluster, DeviceSpec
from autopar.cost_model.precision import supported_dtypes
from autopar.cost_model.validate import cp_problem, dtype_problem, offload_problem
from autopar.graph.types import ModelProfile
from autopar.search.options import SearchOptions

__all__ = [
    "changed_by_settings",
    "cp_choices",
    "dtype_choices",
    "framework_variants",
    "offload_variants",
    "replicate_choices",
]


def framework_variants(spec: str, profile: ModelProfile) -> tuple[str, ...]:
    """The framework specs the planner searches for ``spec`` (module docstring): ``spec``
    first, then with each ``SEARCHED_SETTINGS`` combination it leaves off that applies to the
    profile (a "moe" setting to a model with mixture-of-experts layers)."""
    fw = get_framework(spec)
    has_moe = any(layer.moe is not None for layer in profile.layers)
    extra = [name for name, needs in SEARCHED_SETTINGS.get(fw.name, {}).items()
             if name not in fw.settings and (needs != "moe" or has_moe)]
    combos: list[tuple[str, ...]] = [fw.settings]
    for name in extra:
        combos += [(*combo, name) for combo in combos]
    return tuple(dict.fromkeys(get_framework("+".join((fw.name, *combo))).spec
                               for combo in combos))


def changed_by_settings(fw: Framework, configs: list[ParallelConfig]) -> list[ParallelConfig]:
    """The candidates whose cost ``fw``'s searched settings change (``expert-tp-1``: those
    whose experts it folds, tp > 1); a variant's search costs only these, the framework as
    given having costed the rest the same."""
    return [c for c in configs if not fw.expert_tp_folded or folds_experts(fw, c)]


def cp_choices(data_ranks: int, seq_len: int | None, options: SearchOptions,
               framework: Framework) -> list[int]:
    """Context-parallel degrees for ``data_ranks`` = dp * cp ranks (module docstring)."""
    if seq_len is None or not options.context_parallel or not framework.context_parallel:
        return [1]
    out, cp = [1], 2
    while data_ranks % cp == 0 and cp_problem(cp, seq_len) is None and (
            seq_len // cp >= options.min_cp_tokens):
        if options.max_cp is not None and cp > options.max_cp:
            break
        out.append(cp)
        cp *= 2
    return out


def replicate_choices(dp: int, cp: int, tp: int, zero: int, gpus_per_node: int,
                      options: SearchOptions, framework: Framework) -> list[int]:
    """HSDP replica counts: 1, and the one whose shard group fills one node (at the
    framework's fullest sharding only: zero 3, or Megatron's zero 1)."""
    if zero != max(framework.zero_stages) or not options.hsdp or not framework.hsdp:
        return [1]
    ranks_per_shard = cp * tp
    if gpus_per_node % ranks_per_shard:
        return [1]
    shard = gpus_per_node // ranks_per_shard
    if shard >= dp or dp % shard:
        return [1]
    return [1, dp // shard]


def dtype_choices(device: DeviceSpec | None, options: SearchOptions) -> list[str]:
    """The dtypes to try: ``options.dtype``, or the device's fast ones the framework runs."""
    framework = get_framework(options.framework)
    if options.dtype is not None:
        problem = dtype_problem(device, options.dtype) if device is not None else None
        if problem:  # every candidate would be refused: say why once
            raise ValueError(problem)
        # Likewise when the framework does not train it (the framework record's own words).
        problem = framework_supports(framework, ParallelConfig(global_batch=1,
                                                               dtype=options.dtype))
        if problem:
            raise ValueError(problem)
        return [options.dtype]
    if device is None:
        return ["bf16"]
    wanted = [d for d in supported_dtypes(device) if d in framework.dtypes]
    return wanted or [next(d for d in ("bf16", "fp16", "fp32") if d in framework.dtypes)]


def offload_variants(configs: list[ParallelConfig], cluster: Cluster,
                     options: SearchOptions) -> list[ParallelConfig]:
    """The offloaded variants of ``configs`` the framework and ``options.offloads`` allow:
    the optimizer's state (zero >= 1) and, at zero 3, the parameters too. A candidate with one
    data rank (zero 0 in the space: nothing to shard) is offloaded at zero 1 and 3, as ZeRO-
    Offload runs on one GPU (``config.dp_mechanism``: FSDP2 over the one rank)."""
    framework = get_framework(options.framework)
    if offload_problem("optimizer", cluster):
        return []
    out = []
    for config in configs:
        if config.offload != "none" or (config.zero == 0 and config.data_ranks > 1):
            continue
        for offload in ("optimizer", "params"):
            zero = config.zero or (3 if offload == "params" else 1)
            if offload not in options.offloads or (offload == "params" and zero != 3):
                continue
            variant = dataclasses.replace(config, zero=zero, offload=offload)
            if framework_supports(framework, variant) is None:
                out.append(variant)
    return out
