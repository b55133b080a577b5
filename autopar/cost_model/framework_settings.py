"""The settings a framework's user switches on, what each changes, what each requires, which
the planner searches, and the sources of the overlap fields they switch.

Each setting is off by default, as in the framework itself; ``get_framework("megatron-lm+
tp-comm-overlap")`` turns one on (``Framework.with_settings``, ``setting_changes``), which sets
the record fields of ``SETTING_EFFECTS`` and sources each to the setting; what each requires of
a split is in ``framework_support.py``. A setting
that is a parallelism choice (``SEARCHED_SETTINGS``) the planner also tries by itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from autopar.cost_model.memory import GRAD_BYTES

__all__ = ["EXPANDABLE_FRAGMENTATION", "FSDP2_UNIT", "MEMORY_SETTINGS", "OVERLAP_SOURCES",
           "SEARCHED_SETTINGS", "SETTINGS", "SETTING_EFFECTS", "SETTING_OFF", "setting_changes"]
# The switches a framework's user turns on, each off by default as in the framework itself;
# what each one changes is in ``SETTING_EFFECTS``.
_MEGATRON_ARGS = "sourced: Megatron-LM megatron/training/arguments.py (store_true, default off): "
SETTINGS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "autopar": MappingProxyType({}),
    # torchtitan's enable_async_tensor_parallel is not offered: charged as a full overlap it
    # predicted twice the gain torchtitan's async-TP table measured (9-10%; docs/frameworks.md).
    "torchtitan": MappingProxyType({
        "float8-all-gather": "sourced: torchtitan job_config.py Float8Linear."
                             "enable_fsdp_float8_all_gather (default False, 'recommended for "
                             "tensorwise scaling'): FSDP2 all-gathers the float8 linears' "
                             "weights in float8",
        "cp-rotate-alltoall": "sourced: torchtitan v0.2.2 job_config.py "
                              "context_parallel_rotate_method = 'alltoall' (default "
                              "'allgather'): torch's _AllToAllRotater passes K/V around the "
                              "ring, each step under one block's attention",
        "moe-force-balance": "sourced: torchtitan v0.2.2 job_config.py "
                             "debug.moe_force_load_balance (default False): every expert gets "
                             "the same number of tokens, round-robin",
        "ep-deepep": "sourced: torchtitan v0.2.2 job_config.py "
                     "parallelism.expert_parallel_comm_backend = 'deepep' (default "
                     "'standard', torch all-to-all): DeepEP's dispatch and combine kernels",
        "expert-tp-1": "sourced: torchtitan v0.2.2 job_config.py "
                       "parallelism.expert_tensor_parallel_degree = 1 ('[partial dp + all "
                       "tp -> ep]'; no effect at ep 1): ParallelDims' sparse mesh (pp, "
                       "dp_replicate, efsdp, ep, etp) puts ep on consecutive ranks, efsdp = "
                       "dp_shard * cp * tp / ep",
    }),
    "megatron-lm": MappingProxyType({
        "tp-comm-overlap": _MEGATRON_ARGS + "--tp-comm-overlap: Transformer Engine userbuffers "
                           "overlap the tensor-parallel all-gathers and reduce-scatters with "
                           "the GEMMs",
        "overlap-grad-reduce": _MEGATRON_ARGS + "--overlap-grad-reduce: gradient reductions "
                               "bucketed under the backward (off: after it)",
        "overlap-param-gather": _MEGATRON_ARGS + "--overlap-param-gather: the distributed "
                                "optimizer's parameter all-gather under the forward (off: "
                                "before it)",
        "moe-force-balance": _MEGATRON_ARGS + "--moe-router-force-load-balancing "
                             "(TransformerConfig.moe_router_force_load_balancing): the router "
                             "spreads tokens evenly over the experts, a benchmark mode",
        "expandable-segments": "sourced: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in "
                               "the launch environment (Megatron-LM does not set it; "
                               "Megatron-Bridge's performance recipes do): the caching "
                               "allocator's fragmentation as torchtitan's (3%)",
        "fp8-tensorwise": "sourced: Megatron-Core TransformerConfig.fp8_recipe 'tensorwise' "
                          "(--fp8-recipe; default 'delayed'): per-tensor current scaling, an "
                          "amax pass before each cast",
        "ep-deepep": "sourced: Megatron-LM --moe-token-dispatcher-type flex with "
                     "--moe-flex-dispatcher-backend deepep (the default) or hybridep "
                     "(megatron/core/transformer/transformer_config.py): DeepEP's or "
                     "HybridEP's hierarchical dispatch and combine",
        "expert-tp-1": "sourced: Megatron-LM --expert-tensor-parallel-size 1 "
                       "(ModelParallelConfig.expert_tensor_parallel_size; default the tp "
                       "size), Megatron-Core's MoE parallel folding (arXiv:2504.14960; "
                       "megatron/core/parallel_state.py orders expert ranks tp-ep-dp with "
                       "etp 1): routed experts whole on each rank, each tp rank routing its "
                       "own sequence shard over an ep group of consecutive ranks; every "
                       "Megatron-MoE-ModelZoo config sets it",
        "distribute-saved-activations": _MEGATRON_ARGS + "--distribute-saved-activations "
                                        "(TransformerConfig.distribute_saved_activations): "
                                        "full recompute's saved block input split over the "
                                        "tp group, gathered again before the re-run "
                                        "(checkpoints.py)",
        "accumulate-allreduce-grads-in-fp32": _MEGATRON_ARGS + "--accumulate-allreduce-grads"
                                              "-in-fp32: gradients accumulate in an fp32 "
                                              "main_grad buffer and reduce in fp32, as "
                                              "validate_args sets for --bf16 unless "
                                              "--grad-reduce-in-bf16 (Megatron-LM's default "
                                              "before that flag, 2025)",
        "bf16-adam-moments": _MEGATRON_ARGS + "--use-precision-aware-optimizer with "
                             "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 (defaults fp32; "
                             "Transformer Engine's FusedAdam): Adam's two moments in bf16, 4 "
                             "bytes a parameter instead of 8, sharded by the distributed "
                             "optimizer (DeepSeek-V3 report section 3.3.3 trains so)",
    }),
    "deepspeed": MappingProxyType({
        "overlap-comm": "sourced: DeepSpeed zero_optimization.overlap_comm (default: on for "
                        "stage 3 only, deepspeed/runtime/zero/config.py overlap_comm_valid): "
                        "gradient reductions under the backward",
        "partition-activations": "sourced: DeepSpeed activation_checkpointing."
                                 "partition_activations (default false; deepspeed/runtime/"
                                 "activation_checkpointing/config.py): each checkpointed "
                                 "block input split over the model-parallel (tp) group, "
                                 "all-gathered before the re-run (checkpoints.py)",
        "cpu-checkpointing": "sourced: DeepSpeed activation_checkpointing.cpu_checkpointing "
                             "(default false; deepspeed.ai config-json: 'Offloads partitioned "
                             "activations to CPU if partition_activations is enabled'): the "
                             "partitions in host memory, copied down and up (checkpoints.py)",
    }),
})
# sourced: the caching allocator's unusable share of churning memory with expandable segments
# (frameworks.py _EXPANDABLE): the runtimes that set them, and Megatron-LM's setting.
EXPANDABLE_FRAGMENTATION = 0.03
# setting -> the Framework fields it sets.
SETTING_EFFECTS: Mapping[str, Mapping[str, object]] = MappingProxyType({
    "tp-comm-overlap": {"tp_comm_overlapped": True},
    "overlap-grad-reduce": {"dp_reduce_overlap_stages": (0, 1, 2, 3)},
    "overlap-comm": {"dp_reduce_overlap_stages": (0, 1, 2, 3)},
    "overlap-param-gather": {"param_gather_overlapped": True},
    "float8-all-gather": {"fp8_param_gather": True},
    "cp-rotate-alltoall": {"cp_comm": "ring"},
    "moe-force-balance": {"moe_force_balance": True},
    "ep-deepep": {"ep_dispatch": "hierarchical"},
    "expert-tp-1": {"expert_tp_folded": True},
    "fp8-tensorwise": {"fp8_scaling": "dynamic"},
    "expandable-segments": {"fragmentation_fraction": EXPANDABLE_FRAGMENTATION},
    "partition-activations": {"checkpoint_partitioned": True},
    "distribute-saved-activations": {"checkpoint_partitioned": True},
    "cpu-checkpointing": {"checkpoint_offloaded": True},
    "accumulate-allreduce-grads-in-fp32": {"grad_reduce_bytes": GRAD_BYTES},
    "bf16-adam-moments": {"adam_moment_bytes": 4},
})

FSDP2_UNIT = ("sourced: torch FSDP2 fully_shard per block with forward/backward prefetch of "
              "the next unit (torch/distributed/fsdp/_fully_shard)")
SETTING_OFF = "sourced: off unless the '{}' setting is on (SETTINGS, the framework's default)"
# Settings that are parallelism choices rather than the environment's: the planner plans with
# each off and on (where the model has what it changes: "moe", mixture-of-experts layers) and
# keeps the faster plan, whose framework spec then names it (search/dimensions.py).
# Partitioned checkpoints (partition-activations, distribute-saved-activations) are not
# searched: they trade time for memory only under full recompute at large micro-batches, where
# the planner's splits seldom are, and would double the search.
SEARCHED_SETTINGS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "torchtitan": MappingProxyType({"expert-tp-1": "moe"}),
    "megatron-lm": MappingProxyType({"expert-tp-1": "moe"}),
})
# Settings that free memory at the cost of numerics, not time, which the planner leaves to the
# user: ``autopar plan`` shows what one would buy when the chosen plan recomputes (the chosen
# split without recompute under it: cli/alternatives.py). setting -> its words in the report.
MEMORY_SETTINGS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "megatron-lm": MappingProxyType({"bf16-adam-moments": "Adam's moments in bf16"}),
})
# Where each framework's overlap fields come from (its record's ``sources``).
OVERLAP_SOURCES: Mapping[str, Mapping[str, str]] = {
    "autopar": {
        "tp_comm_overlapped": "sourced: autopar/runtime/tensor_parallel.py (DTensor's "
                              "tensor-parallel collectives run before the matmul that needs "
                              "them)",
        "dp_reduce_overlap_stages": FSDP2_UNIT + "; DDP / replicate() reduce buckets under the "
                                "backward",
        "param_gather_overlapped": FSDP2_UNIT,
    },
    "torchtitan": {
        "tp_comm_overlapped": "sourced: torchtitan's tensor parallelism is DTensor's "
                              "(synchronous collectives; async TP not modelled)",
        "dp_reduce_overlap_stages": FSDP2_UNIT,
        "param_gather_overlapped": FSDP2_UNIT,
    },
    "megatron-lm": {
        "tp_comm_overlapped": SETTING_OFF.format("tp-comm-overlap"),
        "dp_reduce_overlap_stages": SETTING_OFF.format("overlap-grad-reduce"),
        "param_gather_overlapped": SETTING_OFF.format("overlap-param-gather"),
    },
    "deepspeed": {
        "tp_comm_overlapped": "sourced: Megatron-DeepSpeed's tensor-parallel layers "
                              "(synchronous all-reduces)",
        "dp_reduce_overlap_stages": "sourced: DeepSpeed zero_optimization.overlap_comm, "
                                    "default on for stage 3 only (overlap_comm_valid)",
        "param_gather_overlapped": "sourced: DeepSpeed PR #1188 (2021-06, 'ZeRO3, improved "
                                   "parameter all-gather operation'): _all_gather in "
                                   "fetch_sub_module made a sync op, the async one was not "
                                   "async (each all_gather synchronized); ZeRO-1/2 gather the "
                                   "updated parameters after step()",
    },
}


def setting_changes(name: str, settings: tuple[str, ...],
                    sources: Mapping[str, str]) -> dict[str, object]:
    """The record fields ``settings`` of framework ``name`` set (``SETTING_EFFECTS``), the
    sorted settings, and ``sources`` with each changed field's source now the setting's own.

    Raises:
        ValueError: a setting the framework does not have (its settings named).
    """
    known = SETTINGS.get(name, {})
    unknown = [x for x in settings if x not in known]
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)} of framework {name}; its "
                         f"settings: {', '.join(known) or 'none'}")
    changes: dict[str, object] = {"settings": tuple(sorted(set(settings)))}
    new_sources = dict(sources)
    for setting in settings:
        changes.update(SETTING_EFFECTS[setting])
        new_sources.update({field: f"{known[setting]} (setting {setting!r})"
                            for field in SETTING_EFFECTS[setting]})
    changes["sources"] = MappingProxyType(new_sources)
    return changes
