"""Training frameworks: what runs a plan, as one declarative record each.

A prediction is for a named framework: the same split allocates, communicates and overlaps
differently under autopar's own runtime, torchtitan, Megatron-LM and DeepSpeed. Each record
below says, field by field, what the framework does (its allocations, its collectives and their
overlap, its fused kernels, its per-step cost, what it can run) and where that comes from:

- sourced: read in the framework's code or documentation (cited in ``sources``);
- fitted: fitted by ``benchmarks/calibration.py --fit`` on that framework's published runs only
  (benchmarks/data/), reported with leave-one-source-out error (docs/frameworks.md);
- measured: measured here (``autopar calibrate``, ``benchmarks/accuracy.py``, the H200 runs).

``estimate(..., framework=)`` and ``plan(..., framework=)`` take a name from ``FRAMEWORKS``, a
name with the settings its user switched on (``"megatron-lm+tp-comm-overlap+overlap-grad-reduce"``:
``SETTINGS`` lists each framework's, all off by default as in the framework itself), or a
``Framework`` record (``dataclasses.replace`` of one, which is how the calibration fits them
through the public API).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from autopar.config import SCHEDULES
from autopar.cost_model import framework_dimensions as dims
from autopar.cost_model.collectives import MOE_TPS
from autopar.cost_model.compute import ATTENTION_KERNELS
from autopar.cost_model.cp_comm import CP_COMMS
from autopar.cost_model.framework_fit import FIT
from autopar.cost_model.framework_names import FRAMEWORKS
from autopar.cost_model.framework_settings import (
    EXPANDABLE_FRAGMENTATION,
    FSDP2_UNIT,
    SETTINGS,
    setting_changes,
)
from autopar.cost_model.framework_sources import MEMORY_BAND, MEMORY_BAND_SOURCE, default_sources
from autopar.cost_model.framework_support import framework_supports
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.memory import GRAD_BYTES
from autopar.cost_model.moe import EP_DISPATCHES
from autopar.cost_model.pipeline import IN_FLIGHT, PER_MICROBATCH
from autopar.cost_model.precision import FP8_SCALINGS
from autopar.cost_model.presets import DP_OVERLAP, DP_OVERLAP_FIT
from autopar.cost_model.recompute_layers import RECOMPUTE_LAYERS
from autopar.cost_model.stage_splits import STAGE_SPLITS
from autopar.units import MIB

__all__ = ["FRAMEWORKS", "SETTINGS", "Framework",
           "framework_cluster", "framework_supports", "get_framework"]


DDP_BUCKET_BYTES = 25 * MIB  # sourced: DistributedDataParallel's default bucket_cap_mb
# How ZeRO-3 gathers parameters.
GATHER_BLOCK = "block"  # FSDP2: one unit per block, the next one prefetched
GATHER_BUCKET = "bucket"  # DeepSpeed stage 3: parameters gathered in bounded buckets


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Framework:
    """One training framework's behaviour, as the cost model and the search use it.

    Attributes:
        name: the framework's name (``FRAMEWORKS``).
        runtime: what runs, in words (release the record describes).
        pipeline_recv_buffers: ``per_microbatch`` (torch's PipelineStage keeps a receive buffer
            per micro-batch for the whole step) or ``in_flight`` (a tensor per transfer, freed
            with its micro-batch: at most one forward and one backward buffer per chunk).
        zero3_gather: ``block`` (one block's parameters gathered at a time, the next prefetched)
            or ``bucket`` (at most ``zero3_live_params`` gathered parameters live at once).
        zero3_live_params: the bucket bound of ``bucket`` gathering (parameters).
        reduce_bucket_params: gradient elements reduced per bucket (DDP / ZeRO-1/2 reductions;
            bounds the unreduced gradient copies and the exposed last reduction).
        fragmentation_fraction: the caching allocator's unusable share of the memory that churns
            over a step (activations, gathered parameters, working buffers): reserved but not
            live at the peak.
        loss_parallel: the loss runs on vocab-parallel logits (no all-gather of the logits
            under tensor parallelism; each rank keeps its vocabulary shard).
        sp_regathers_inputs: under sequence parallelism the backward all-gathers a
            column-parallel linear's input again instead of keeping the gathered copy (the
            saved input stays sequence-sharded: Korthikanti et al. 2022's 34/t).
        grad_reduce_bytes: bytes per element of the data-parallel gradient reductions (4: fp32
            reduce dtype; 2: reduced at the 16-bit training dtype).
        selective_policy: what recompute mode ``selective`` runs: ``attention`` (the attention
            core re-runs, Megatron's) or ``op`` (per-op checkpointing: a block keeps its input
            and its save list's outputs, the rest re-runs; ``LayerProfile.op_sac``).
        settings: the switches of ``SETTINGS[name]`` the user turned on (sorted).
        tp_comm_overlapped: tensor-parallel collectives run under the layer's GEMMs (hidden up
            to the layer's compute, slowing it by ``overlap_slowdown``); else they wait.
        dp_reduce_overlap_stages: the ZeRO stages (0-3) whose data-parallel gradient reductions
            run under the backward (within ``dp_overlap_efficiency`` of it); the others after it.
        param_gather_overlapped: per-step ZeRO parameter all-gathers run under the forward;
            else before it.
        dp_comm_efficiency: achieved over modelled bus bandwidth of the framework's
            data-parallel collectives (fitted; 1 = the nccl-tests figures).
        zero3_comm_efficiency: the same, further, for ZeRO-3 parameter gathers and gradient
            reductions (the framework's own fetch machinery; DeepSpeed: its own measurement).
        param_traffic_factor: per-micro-batch traffic over the parameters (weight casts,
            gradient accumulation) relative to autopar's eager runtime; 0 where the weight
            gradient GEMM accumulates in place (Megatron's gradient_accumulation_fusion).
            None: the cluster's own value (autopar: measured).
        elementwise_traffic_scale: the non-matmul memory traffic relative to the device's
            eager figure (fused norms, bias-activation and softmax kernels move less).
        kernel_efficiency: the framework's matmul-heavy block throughput relative to the
            device's eager curve (fitted).
        dp_overlap_efficiency: usable fraction of the compute window that hides data-parallel
            collectives; None: the cluster's value (autopar: measured).
        overlap_slowdown: compute slowed while collectives overlap it (NCCL kernels take SMs
            and memory bandwidth), as a fraction of the overlapped communication time.
        step_overhead_s: fixed seconds per optimizer step outside the layers (data loading,
            gradient-norm clipping, optimizer launch, logging, the first parameter gather).
        first_gather_exposed: whether the step's first ZeRO parameter gather waits in full.
        schedules: pipeline schedules it runs.
        zero_stages: ZeRO / FSDP stages it runs.
        zero_with_pipeline: the largest ZeRO stage it runs together with pipeline parallelism.
        sequence_parallel: whether it runs Megatron-style sequence parallelism.
        recompute_layers: the per-layer recompute it sets (recompute_layers.RECOMPUTE_LAYERS):
            any mix, the first n blocks of each stage, every n-th block, or one mode.
        stage_splits: the pipeline stage splits it cuts (stage_splits.STAGE_SPLITS).
        exports: autopar's export formats whose output this framework runs (slurm: autopar's).
        memory_band: relative error of predicted peak memory this framework's runs showed (the
            largest one; ``plan --robust`` keeps this much memory free).
        step_time_band: (low, high) factors on the predicted step time holding 80% of this
            framework's leave-one-source-out outcomes (measured / predicted, p10 and p90).
        context_parallel ... fsdp_root_holds_edges: the other dimensions and kernels, each a
            field of framework_dimensions.DIMENSIONS (documented there); checkpoint_partitioned and
            checkpoint_offloaded: checkpoints.py's, off unless a setting turns it on;
            adam_moment_bytes: bytes a parameter of Adam's two moments (8 fp32, 4 bf16).
        interleaved_groups_of_pp: interleaves in groups of pp micro-batches (pp divides m).
        sources: field -> "sourced: ...", "fitted: ..." or "measured: ...".
        expert_parallel: whether it shards mixture-of-experts layers' experts over ranks (ep).
        ep_needs_sharded_dp: ep must sit inside a sharded (ZeRO / FSDP) data-parallel
            dimension (zero >= 1), not a replicated one.
        ep_with_tp: whether it runs ep together with tp > 1.
        fp8_scaling: how its fp8 linears get their scales (precision.py): ``dynamic``
            (torchao tensorwise: an amax pass before each cast, weights cast every
            micro-batch) or ``delayed`` (Transformer Engine's DelayedScaling: the scale from
            the amax history, the amax taken inside the cast, fp8 weights cached per step).
        fp8_param_gather: FSDP all-gathers the fp8 linears' weights in fp8 (1 byte each)
            instead of the 16-bit parameter dtype.
        loss_grad_in_place: the loss's backward turns its saved fp32 softmax into the logits'
            gradient in place (only the 16-bit copy for the output layer is new), instead of
            allocating fp32 gradients of the log-probabilities and of the logits.
    """

    name: str
    runtime: str
    pipeline_recv_buffers: str
    zero3_gather: str
    zero3_live_params: float
    reduce_bucket_params: float
    fragmentation_fraction: float
    loss_parallel: bool
    sp_regathers_inputs: bool
    grad_reduce_bytes: int
    selective_policy: str
    tp_comm_overlapped: bool
    dp_reduce_overlap_stages: tuple[int, ...]
    param_gather_overlapped: bool
    dp_comm_efficiency: float
    zero3_comm_efficiency: float
    param_traffic_factor: float | None
    elementwise_traffic_scale: float
    kernel_efficiency: float
    dp_overlap_efficiency: float | None
    overlap_slowdown: float
    step_overhead_s: float
    first_gather_exposed: bool
    schedules: tuple[str, ...]
    zero_stages: tuple[int, ...]
    zero_with_pipeline: int
    sequence_parallel: bool
    recompute_layers: str
    stage_splits: str
    exports: tuple[str, ...]
    memory_band: float
    step_time_band: tuple[float, float]
    context_parallel: bool
    hsdp: bool
    offloads: tuple[str, ...]
    dtypes: tuple[str, ...]
    sources: Mapping[str, str]
    settings: tuple[str, ...] = ()
    expert_parallel: bool = False
    ep_needs_sharded_dp: bool = False
    ep_with_tp: bool = True
    fp8_scaling: str = "dynamic"
    fp8_param_gather: bool = False
    loss_grad_in_place: bool = False
    ep_with_cp: bool = True
    moe_zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    cp_comm: str = "ring"
    offload_optimizer_moves_params: bool = False
    expert_gemm_calls: int = 0
    expert_tensor_parallel: bool = True
    expert_tp_folded: bool = False
    fold_needs_ep: bool = False
    moe_sequence_parallel: bool = True
    moe_tp: str = "linears"
    attention_kernel: str = "fused"
    fused_swiglu: bool = False
    native_gqa: bool = False
    fp8_saves_inputs: bool = False
    fused_norms: bool = False
    scatter_combine: bool = False
    moe_force_balance: bool = False
    ep_dispatch: str = "all_to_all"
    runs_traced_modules: bool = False
    checkpoint_partitioned: bool = False
    checkpoint_offloaded: bool = False
    adam_moment_bytes: int = 8
    interleaved_groups_of_pp: bool = False
    static_grad_buffer: bool = False
    fsdp_root_holds_edges: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (
                ("cp_comm", CP_COMMS), ("attention_kernel", ATTENTION_KERNELS),
                ("fp8_scaling", FP8_SCALINGS), ("selective_policy", ("attention", "op")),
                ("recompute_layers", RECOMPUTE_LAYERS), ("stage_splits", STAGE_SPLITS),
                ("ep_dispatch", EP_DISPATCHES), ("moe_tp", MOE_TPS),
                ("pipeline_recv_buffers", (PER_MICROBATCH, IN_FLIGHT)),
                ("zero3_gather", (GATHER_BLOCK, GATHER_BUCKET))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r} unknown; use one of {allowed}")
        for name in ("kernel_efficiency", "elementwise_traffic_scale", "dp_comm_efficiency",
                     "zero3_comm_efficiency"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Framework.{name} must be > 0")
        for name in ("fragmentation_fraction", "overlap_slowdown", "step_overhead_s"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"Framework.{name} must be >= 0, got {value!r}")
        if not 0 < self.step_time_band[0] <= self.step_time_band[1]:
            raise ValueError(f"Framework.step_time_band {self.step_time_band}: need low <= high")
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if unknown:
            raise ValueError(f"Framework.schedules: unknown {unknown}")

    def with_fit(self, **values: float) -> Framework:
        """The record with some fitted fields replaced (what calibration tries)."""
        return dataclasses.replace(self, **values)

    @property
    def spec(self) -> str:
        """The name with its settings, as ``get_framework`` reads it and a Plan records it."""
        return "+".join((self.name, *self.settings))

    def with_settings(self, settings: tuple[str, ...]) -> Framework:
        """The record with ``settings`` (switches of ``SETTINGS[name]``) turned on, each
        changed field sourced to its setting (``framework_settings.setting_changes``)."""
        changes = setting_changes(self.name, settings, self.sources)
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


_TORCH_SCHEDULES = SCHEDULES  # torch.distributed.pipelining's, by autopar's names

_MEGATRON_XENT = ("sourced: megatron/core/tensor_parallel/cross_entropy.py "
                  "_VocabParallelCrossEntropy: saves exp_logits (the softmax of the fp32 "
                  "logits); backward sets grad_input = softmax and updates it in place")
_MEGATRON_P2P = ("sourced: Megatron-LM megatron/core/pipeline_parallel/p2p_communication.py "
                 "(_communicate allocates torch.empty receive tensors per transfer)")
_TORCH_STAGE = ("sourced: torch/distributed/pipelining/stage.py (_setup_forward_recv_info, "
                "_create_grad_recv_info: one buffer per micro-batch, kept for the step)")
_DS_BUCKETS = ("sourced: DeepSpeed config docs (deepspeed.ai/docs/config-json): "
               "stage3_max_live_parameters 1e9, reduce_bucket_size 5e8 (defaults)")
_EXPANDABLE = ("sourced: PyTorch CUDA caching allocator notes (expandable_segments avoids "
               "most fragmentation of churning blocks); 3% charged")
_NO_EXPANDABLE = ("sourced: PyTorch CUDA caching allocator without expandable segments "
                  "(memory_stats: reserved exceeds allocated by 5-10% on varied sizes); 7% "
                  "charged")

_RECORDS: dict[str, dict[str, object]] = {
    "autopar": dict(
        runtime="autopar's runtime (torch 2.13: FSDP2, DTensor, torch.distributed.pipelining)",
        selective_policy="attention",
        tp_comm_overlapped=False, dp_reduce_overlap_stages=(0, 1, 2, 3),
        param_gather_overlapped=True,
        pipeline_recv_buffers=IN_FLIGHT, zero3_gather=GATHER_BLOCK,
        zero3_live_params=0.0, reduce_bucket_params=DDP_BUCKET_BYTES / GRAD_BYTES,
        fragmentation_fraction=EXPANDABLE_FRAGMENTATION,
        param_traffic_factor=None, elementwise_traffic_scale=1.0,
        dp_overlap_efficiency=None, first_gather_exposed=True, memory_band=MEMORY_BAND,
        loss_parallel=True, grad_reduce_bytes=GRAD_BYTES, sp_regathers_inputs=False,
        schedules=_TORCH_SCHEDULES, zero_stages=(0, 1, 2, 3), zero_with_pipeline=3,
        sequence_parallel=True, exports=("slurm",),
        expert_parallel=True, ep_with_tp=True,
        sources={
            "expert_parallel": "sourced: autopar/runtime/expert_parallel.py (the zoo's and "
                               "Hugging Face's stacked experts over ep ranks, "
                               "all_to_all_single dispatch and combine; "
                               "tests/distributed/test_runtime_moe.py, test_hf_splits.py)",
            "loss_parallel": "sourced: autopar/runtime/loss.py (the default loss under "
                             "torch's loss_parallel() on Shard(-1) logits)",
            "ep_with_tp": "sourced: autopar/runtime/expert_parallel.py ep_groups (one ep "
                          "group per tp index; test_runtime_moe.py dp 2 x tp 2 ep 2)",
            "pipeline_recv_buffers": "measured: autopar/runtime/lean_pipeline.py receives into "
                                     "a tensor per transfer and drops it with its micro-batch "
                                     "(tests/distributed/test_pipeline_buffers.py: pp=4 peak "
                                     "flat from 4 to 32 micro-batches)",
            "zero3_gather": FSDP2_UNIT,
            "reduce_bucket_params": "sourced: DistributedDataParallel bucket_cap_mb=25",
            "fragmentation_fraction": _EXPANDABLE + " (autopar's launcher sets it)",
            "param_traffic_factor": "measured: the cluster's value (H200 runs, calibrate)",
            "dp_overlap_efficiency": "measured: the cluster's value (autopar calibrate)",
            "kernel_efficiency": "measured: 1 by definition (the device curve is this runtime)",
            "step_overhead_s": "measured: in the device's per-layer overheads (calibrate)",
            "overlap_slowdown": "sourced: arXiv:2507.03114 (18.9% average compute slowdown "
                                "under overlapped NCCL collectives); on CPU gloo has no "
                                "overlap window (dp_overlap_efficiency 0), so it adds nothing",
            "step_time_band": "measured: p10-p90 of measured / predicted step time over 48 CPU "
                              "runs (benchmarks/accuracy.py, three sessions) and 6 H200 plans "
                              "(benchmarks/gpu_verify.py); benchmarks/autopar_band.py",
            "sp_regathers_inputs": "measured: DTensor's colwise linear keeps the gathered input "
                                   "(tests/unit/test_cost_memory_runtime.py)",
            "grad_reduce_bytes": "sourced: autopar's FSDP2 MixedPrecisionPolicy reduce_dtype "
                                 "float32",
            "memory_band": f"measured: {MEMORY_BAND_SOURCE}",
        },
    ),
    "torchtitan": dict(
        runtime="torchtitan 0.1-0.2 (FSDP2 per block, torch pipelining, eager or compiled)",
        selective_policy="op",
        tp_comm_overlapped=False, dp_reduce_overlap_stages=(0, 1, 2, 3),
        param_gather_overlapped=True,
        pipeline_recv_buffers=PER_MICROBATCH, zero3_gather=GATHER_BLOCK,
        zero3_live_params=0.0, reduce_bucket_params=DDP_BUCKET_BYTES / GRAD_BYTES,
        fragmentation_fraction=EXPANDABLE_FRAGMENTATION,
        param_traffic_factor=1.0, elementwise_traffic_scale=1.0,
        dp_overlap_efficiency=DP_OVERLAP, first_gather_exposed=True, memory_band=MEMORY_BAND,
        loss_parallel=True, grad_reduce_bytes=GRAD_BYTES, sp_regathers_inputs=False,
        schedules=_TORCH_SCHEDULES, zero_stages=(0, 1, 2, 3), zero_with_pipeline=3,
        sequence_parallel=True, exports=("torchtitan",),
        expert_parallel=True, ep_needs_sharded_dp=True,
        sources={
            "ep_needs_sharded_dp": "sourced: torchtitan job_config.py Parallelism."
                                   "expert_parallel_degree: with etp = tp, ep divides "
                                   "dp_shard * cp (data_parallel_replicate cannot hold it)",
            "expert_parallel": "sourced: torchtitan parallelism.expert_parallel_degree "
                               "(torchtitan/distributed/expert_parallel.py: all-to-all "
                               "token dispatch, experts sharded over dp_shard x cp)",
            "pipeline_recv_buffers": _TORCH_STAGE,
            "zero3_gather": FSDP2_UNIT + "; torchtitan parallelize_llama wraps each block",
            "selective_policy": "sourced: torchtitan activation_checkpoint mode 'selective' with "
                                "selective_ac_option 'op' (what autopar's torchtitan export "
                                "writes): _save_list (mm, SDPA kernels) minus every second mm "
                                "(torchtitan/models/llama3/infra/parallelize.py _apply_ac)",
            "sp_regathers_inputs": "sourced: torchtitan's SP is DTensor's (the gathered input "
                                   "is kept, as in autopar's runtime)",
            "loss_parallel": "sourced: torchtitan parallelism.disable_loss_parallel=False "
                             "(loss_parallel context over the vocab-sharded logits)",
            "grad_reduce_bytes": "sourced: torchtitan MixedPrecisionPolicy(reduce_dtype="
                                 "float32) (training.mixed_precision_reduce)",
            "reduce_bucket_params": "sourced: DDP default bucket (data_parallel_replicate)",
            "fragmentation_fraction": _EXPANDABLE + " (torchtitan's run script sets it)",
            "param_traffic_factor": "sourced: FSDP2 MixedPrecisionPolicy(param bf16, reduce "
                                    "fp32): fp32 gradient accumulation as autopar's",
            "dp_overlap_efficiency": f"{DP_OVERLAP_FIT} (FSDP2 prefetch alike)",
            "zero_stages": "sourced: torchtitan parallel dims dp_shard (FSDP2, zero 3; "
                           "fsdp_reshard_after_forward='never' keeps parameters gathered "
                           "between forward and backward: zero 1 and 2) / dp_replicate (DDP)",
        },
    ),
    "megatron-lm": dict(
        runtime="Megatron-LM / Megatron-Core (NeMo) with Transformer Engine kernels",
        selective_policy="attention",
        tp_comm_overlapped=False, dp_reduce_overlap_stages=(), param_gather_overlapped=False,
        pipeline_recv_buffers=IN_FLIGHT, zero3_gather=GATHER_BLOCK,
        zero3_live_params=0.0, reduce_bucket_params=4e7,
        fragmentation_fraction=0.07, param_traffic_factor=0.0, elementwise_traffic_scale=1.0,
        dp_overlap_efficiency=DP_OVERLAP, first_gather_exposed=True, memory_band=MEMORY_BAND,
        loss_parallel=True, grad_reduce_bytes=2, sp_regathers_inputs=True,
        schedules=("1f1b", "interleaved-1f1b"), zero_stages=(0, 1), zero_with_pipeline=1,
        sequence_parallel=True, exports=("megatron",),
        expert_parallel=True, fp8_scaling="delayed", loss_grad_in_place=True,
        interleaved_groups_of_pp=True,
        sources={
            "interleaved_groups_of_pp": "sourced: megatron/core/pipeline_parallel/schedules.py"
                                        " (interleaving: N contiguous micro-batches, default "
                                        "pp, in [pp, m]; m % N 0 or >= pp)",
            "loss_grad_in_place": _MEGATRON_XENT,
            "fp8_scaling": "sourced: Megatron-Core --fp8-recipe delayed (default) runs "
                           "Transformer Engine's DelayedScaling recipe; TE user guide "
                           "'Performance Optimizations': FP8 weight caching (is_first_microbatch"
                           ": weights cast once per step) and fused LayerNormLinear / "
                           "LayerNormMLP casts",
            "expert_parallel": "sourced: Megatron-Core MoE --expert-model-parallel-size "
                               "(megatron/core/transformer/moe, alltoall token dispatcher)",
            "pipeline_recv_buffers": _MEGATRON_P2P,
            "loss_parallel": "sourced: megatron/core/tensor_parallel/cross_entropy.py "
                             "(vocab_parallel_cross_entropy)",
            "sp_regathers_inputs": "sourced: megatron/core/tensor_parallel/layers.py "
                                   "LinearWithGradAccumulationAndAsyncCommunication saves the "
                                   "sharded input and all-gathers it again in backward",
            "grad_reduce_bytes": "sourced: --grad-reduce-in-bf16 (exported; Megatron-Bridge's "
                                 "perf recipes' grad_reduce_in_fp32=False): bf16 main_grad",
            "reduce_bucket_params": "sourced: Megatron-Core DDP bucket_size default "
                                    "max(40000000, 1000000 * dp) (distributed_data_parallel)",
            "fragmentation_fraction": _NO_EXPANDABLE,
            "param_traffic_factor": "sourced: --gradient-accumulation-fusion (default on): "
                                    "wgrad GEMM accumulates into main_grad; bf16 params",
            "zero_stages": "sourced: --use-distributed-optimizer shards optimizer state "
                           "(ZeRO-1); parameters and gradients replicated",
            "schedules": "sourced: schedules.py forward_backward_pipelining_without/with_"
                         "interleaving",
            "dp_overlap_efficiency": f"{DP_OVERLAP_FIT} (--overlap-grad-reduce buckets "
                                     "overlap the backward)",
        },
    ),
    "deepspeed": dict(
        runtime="DeepSpeed 0.x ZeRO stages 0-3 (Megatron-DeepSpeed for tp/pp)",
        selective_policy="attention",
        tp_comm_overlapped=False, dp_reduce_overlap_stages=(3,),
        param_gather_overlapped=False, zero3_comm_efficiency=0.18,
        pipeline_recv_buffers=IN_FLIGHT, zero3_gather=GATHER_BUCKET,
        zero3_live_params=1e9, reduce_bucket_params=5e8,
        fragmentation_fraction=0.07, param_traffic_factor=1.0, elementwise_traffic_scale=1.0,
        dp_overlap_efficiency=DP_OVERLAP, first_gather_exposed=True, memory_band=MEMORY_BAND,
        loss_parallel=True, grad_reduce_bytes=2, sp_regathers_inputs=True,
        schedules=("1f1b",), zero_stages=(0, 1, 2, 3), zero_with_pipeline=1,
        sequence_parallel=False, exports=("deepspeed",),
        expert_parallel=True, loss_grad_in_place=True,
        sources={
            "loss_grad_in_place": _MEGATRON_XENT + " (Megatron-DeepSpeed's)",
            "expert_parallel": "sourced: deepspeed.moe.layer.MoE(ep_size=...) (DeepSpeed-MoE, "
                               "Rajbhandari et al. 2022); set in model code, not in the "
                               "JSON config",
            "pipeline_recv_buffers": "sourced: deepspeed/runtime/pipe/engine.py "
                                     "(num_pipe_buffers = min(stages - stage_id, micro_batches))",
            "zero3_gather": _DS_BUCKETS,
            "zero3_comm_efficiency": "sourced: DeepSpeed PR #1188's measurement (5.1B BERT, "
                                     "one p4d node, 8 A100 NVLink): ZeRO-3 forward 270 ms vs "
                                     "about 60 ms without the fetch (issue #1174) -> 10.2 GB "
                                     "gathered in 210 ms, where the ring model gives 0.875 x "
                                     "10.2 GB / 230 GB/s = 39 ms: 0.18",
            "sp_regathers_inputs": "sourced: DeepSpeed has no sequence parallelism of this "
                                   "kind (the field is moot: sequence_parallel=False)",
            "loss_parallel": "sourced: Megatron-DeepSpeed's vocab-parallel cross entropy "
                             "(the tp runs); no logits gather without tp",
            "grad_reduce_bytes": "sourced: DeepSpeed fp16/bf16 engines reduce the 16-bit "
                                 "gradients (communication_data_type defaults to the model "
                                 "dtype)",
            "reduce_bucket_params": _DS_BUCKETS,
            "fragmentation_fraction": _NO_EXPANDABLE,
            "param_traffic_factor": "sourced: fp16/bf16 optimizer keeps fp32 master weights and "
                                    "accumulates gradients per micro-batch (as autopar's)",
            "zero_stages": "sourced: deepspeed.ai ZeRO tutorial; pipeline engine supports "
                           "ZeRO-1 only",
            "schedules": "sourced: deepspeed/runtime/pipe/schedule.py TrainSchedule (1F1B)",
            "dp_overlap_efficiency": f"{DP_OVERLAP_FIT} (overlap_comm)",
        },
    ),
}


def _build(name: str) -> Framework:
    fields = {**FIT[name], **_RECORDS[name], **dims.DIMENSIONS[name]}
    sources = {**fields.pop("sources"), **dims.DIMENSION_SOURCES[name]}  # type: ignore[dict-item]
    sources = {**default_sources(name), **sources}
    return Framework(name=name, sources=MappingProxyType(sources), **fields)  # type: ignore[arg-type]


_BY_NAME: Mapping[str, Framework] = MappingProxyType({n: _build(n) for n in FRAMEWORKS})


def get_framework(framework: str | Framework) -> Framework:
    """The record of ``framework``: a name from ``FRAMEWORKS``, optionally with the settings
    its user turned on (``"megatron-lm+tp-comm-overlap"``), or a Framework itself (raises
    ValueError naming the known ones for an unknown name)."""
    if isinstance(framework, Framework):
        return framework
    if isinstance(framework, str):
        name, *settings = framework.lower().split("+")
        if name in _BY_NAME:
            return _BY_NAME[name].with_settings(tuple(settings)) if settings else _BY_NAME[name]
    raise ValueError(f"unknown framework {framework!r}; use one of {', '.join(FRAMEWORKS)} "
                     "(with settings: name+setting+..., see autopar.SETTINGS)")


def framework_cluster(cluster: Cluster, framework: Framework) -> Cluster:
    """The cluster as ``framework`` drives it: its kernels' efficiency and traffic, its
    parameter traffic and overlap where the record sets them (None keeps the cluster's)."""
    fw = framework
    device = dataclasses.replace(
        cluster.device,
        matmul_efficiency_max=min(1.0, cluster.device.matmul_efficiency_max
                                  * fw.kernel_efficiency),
        elementwise_traffic_factor=cluster.device.elementwise_traffic_factor
        * fw.elementwise_traffic_scale,
    )
    changes: dict[str, object] = {"device": device}
    if fw.param_traffic_factor is not None:
        changes["param_traffic_factor"] = fw.param_traffic_factor
    if fw.dp_overlap_efficiency is not None:
        changes["dp_overlap_efficiency"] = fw.dp_overlap_efficiency
    if device == cluster.device and len(changes) == 1:
        return cluster
    return dataclasses.replace(cluster, **changes)  # type: ignore[arg-type]
