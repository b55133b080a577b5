"""ParallelConfig: one way to split a training job (degrees, micro-batching, schedule, memory).

The config validates only its own fields. Whatever needs the model or the cluster (world size,
heads divisible by tp, micro-batches per pipeline for a schedule) is checked by ``estimate()`` and
``plan()``, which raise ``ValueError`` naming the constraint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from autopar.schedules import DEFAULT_SCHEDULE, SCHEDULE_NAMES, check_schedule, get_schedule

__all__ = [
    "DTYPES",
    "DTYPE_BYTES",
    "FP8_ELEMENT_BYTES",
    "MAX_GLOBAL_BATCH",
    "MAX_SEQ_LEN",
    "MESH_AXES",
    "OFFLOADS",
    "RECOMPUTE",
    "SCHEDULES",
    "TORCH_DTYPE_NAMES",
    "ZERO_STAGES",
    "ParallelConfig",
    "base_dtype",
    "dp_mechanism",
    "mesh_strides",
    "uses_autocast",
]

# Pipeline schedules by name (records and rules in autopar/schedules.py).
SCHEDULES: tuple[str, ...] = SCHEDULE_NAMES
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
# ZeRO stages (data_parallel.py: what each means in torch terms).
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
# fp8: fp8 matmuls (torchao float8 / Transformer Engine) with bf16 everywhere else, so its
# stored tensors (parameters, gradients, activations) are 2 bytes like bf16.
DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32", "fp8")
# The token cross entropy's kernel a profile runs (autopar.models.losses): torch's on fp32
# logits, or a fused one that keeps the logits and a log-sum-exp per token.
LOSS_KERNELS: tuple[str, ...] = ("eager", "fused")
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}
# One float8 element (e4m3 / e5m2): what an fp8 matmul's operands and an fp8 all-gather move.
FP8_ELEMENT_BYTES = 1


def base_dtype(dtype: str) -> str:
    """The dtype of everything but fp8's matmuls (attention, norms, stored tensors): bf16 under
    fp8, otherwise the training dtype itself."""
    return "bf16" if dtype == "fp8" else dtype

# The torch dtype (``torch.<name>``) of each stored-tensor dtype the runtime and profiler use.
TORCH_DTYPE_NAMES: Mapping[str, str] = MappingProxyType(
    {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
)
# What lives in host memory: nothing, the optimizer (fp32 master weights and Adam moments, with
# the optimizer step on the CPU as in ZeRO-Offload and FSDP2's CPUOffloadPolicy), or the
# parameters and gradients too (ZeRO-Infinity / CPUOffloadPolicy with fully_shard).
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "params")
# The largest global batch autopar plans for, in sequences: published runs use at most ~10^4
# (16M tokens of 2k); the bound keeps the search's loops over its divisors short.
MAX_GLOBAL_BATCH = 2**24
# The longest sequence autopar profiles, in tokens (16M; the longest published context is ~10M).
MAX_SEQ_LEN = 2**24


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """A split of one training step over ``dp * cp * tp * pp`` devices.

    Attributes:
        dp: data-parallel degree (replicas, or shards under ZeRO/FSDP).
        cp: context-parallel degree: each sequence sharded over cp ranks (ring attention).
        tp: tensor-parallel degree (innermost mesh axis).
        pp: pipeline-parallel degree (number of pipeline ranks).
        ep: expert-parallel degree of mixture-of-experts layers; divides ``dp * cp`` (experts
            sharded over ranks that hold data/context replicas of the dense layers).
        dp_replicate: HSDP replicas: ``dp = dp_replicate * shard``; divides dp, needs zero >= 1.
        offload: none | optimizer | params: what lives in host memory (needs zero >= 1;
            params needs zero 3).
        micro_batch: sequences per micro-batch per data-parallel replica.
        global_batch: sequences per optimizer step for the whole job.
        schedule: pipeline schedule name (see ``SCHEDULES``); ignored when pp == 1.
        virtual_stages: model chunks per pipeline rank (>= 2 for interleaved schedules at
            pp > 1; 1 at pp == 1).
        recompute: activation recomputation for every layer: none | selective | full.
        sequence_parallel: shard norms/dropout activations along the sequence over tp.
        zero: 0 replicated (DDP / replicate()), 1 and 2 (FSDP2 keeping parameters unsharded
            between forward and backward), 3 (FSDP2 fully_shard).
        dtype: training precision: bf16 (default), fp16, fp32, fp8 (fp8 matmuls, bf16 elsewhere).
    """

    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    offload: str = "none"
    micro_batch: int = 1
    global_batch: int
    schedule: str = DEFAULT_SCHEDULE
    virtual_stages: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    zero: int = 0
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp", "pp", "ep", "dp_replicate", "micro_batch",
                     "global_batch", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")
        if self.global_batch > MAX_GLOBAL_BATCH:
            raise ValueError(
                f"ParallelConfig.global_batch {self.global_batch} is above autopar's bound of "
                f"{MAX_GLOBAL_BATCH} sequences; pick a smaller global batch"
            )
        get_schedule(self.schedule)  # ValueError naming the known schedules
        if self.recompute not in RECOMPUTE:
            raise ValueError(
                f"ParallelConfig.recompute {self.recompute!r} is unknown; use one of {RECOMPUTE}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"ParallelConfig.dtype {self.dtype!r} is unknown; use one of {DTYPES}")
        if type(self.zero) is not int or self.zero not in ZERO_STAGES:
            raise ValueError(f"ParallelConfig.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError("ParallelConfig.sequence_parallel must be true or false")
        self._check_new_dimensions()
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(
                f"global_batch {self.global_batch} is not divisible by dp * micro_batch = "
                f"{self.dp} * {self.micro_batch}; pick a global batch that is a multiple of "
                f"{self.dp * self.micro_batch}"
            )
        check_schedule(self.schedule, self.pp, self.virtual_stages)

    def _check_new_dimensions(self) -> None:
        """The rules of ep, dp_replicate and offload (DESIGN: dimensions beyond dp x tp x pp)."""
        if self.data_ranks % self.ep:
            raise ValueError(
                f"ParallelConfig.ep {self.ep} does not divide dp * cp = {self.data_ranks}: "
                "experts are sharded over the data/context-parallel ranks; pick ep dividing dp * cp"
            )
        if self.dp % self.dp_replicate:
            raise ValueError(
                f"ParallelConfig.dp_replicate {self.dp_replicate} does not divide dp {self.dp}; "
                "HSDP is dp_replicate replicas of a dp / dp_replicate-way shard"
            )
        if self.dp_replicate > 1 and self.zero == 0:
            raise ValueError(
                "ParallelConfig.dp_replicate > 1 (HSDP) needs zero >= 1 (a shard group)"
            )
        if self.offload not in OFFLOADS:
            raise ValueError(
                f"ParallelConfig.offload {self.offload!r} is unknown; use one of {OFFLOADS}"
            )
        if self.offload != "none" and self.zero == 0:
            raise ValueError("ParallelConfig.offload needs zero >= 1 (offload moves sharded state)")
        if self.offload == "params" and self.zero != 3:
            raise ValueError("ParallelConfig.offload='params' needs zero=3 (parameters sharded)")

    @property
    def world_size(self) -> int:
        """Devices the config occupies: dp * cp * tp * pp."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_shard(self) -> int:
        """Ranks a ZeRO/FSDP shard group spans: dp / dp_replicate (dp itself without HSDP)."""
        return self.dp // self.dp_replicate

    @property
    def data_ranks(self) -> int:
        """dp * cp: the ranks that hold the same parameters (context-parallel ranks hold whole
        layers), over which gradients are reduced."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """dp_shard * cp: the ZeRO / FSDP2 shard group (HSDP's replicas are the outer part of
        dp)."""
        return self.dp_shard * self.cp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline per step: global_batch / (dp * micro_batch)."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def num_stages(self) -> int:
        """Pipeline stages in the model: pp * virtual_stages (1 when pp == 1)."""
        return self.pp * self.virtual_stages if self.pp > 1 else 1

    def to_dict(self) -> dict[str, Any]:
        """The config's fields as a JSON-ready dict (field order kept)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelConfig:
        """Build a config from ``to_dict()`` output; unknown keys are an error."""
        if not isinstance(data, dict):
            raise ValueError(f"a ParallelConfig is read from an object of its fields, got "
                             f"{type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(repr(k) if not isinstance(k, str) else k for k in set(data) - names)
        if unknown:
            raise ValueError(f"unknown ParallelConfig field(s): {', '.join(unknown)}")
        return cls(**data)

    def describe(self) -> str:
        """A one-line summary, e.g. ``dp=8 tp=8 pp=16 mb=1 1f1b zero=1 recompute=full``."""
        parts = [f"dp={self.dp}"]
        if self.dp_replicate > 1:
            parts.append(f"(hsdp {self.dp_replicate}x{self.dp_shard})")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        parts += [f"tp={self.tp}", f"pp={self.pp}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        parts.append(f"mb={self.micro_batch}")
        if self.pp > 1:
            sched = self.schedule
            if self.virtual_stages > 1:
                sched += f"(v={self.virtual_stages})"
            parts.append(sched)
        parts.append(f"zero={self.zero}")
        parts.append(f"recompute={self.recompute}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        parts.append(self.dtype)
        return " ".join(parts)


def uses_autocast(config: ParallelConfig) -> bool:
    """Whether the runtime runs the forward under ``torch.autocast``: 16-bit training, except
    under FSDP2, whose ``MixedPrecisionPolicy`` casts the parameters itself."""
    return config.dtype != "fp32" and dp_mechanism(config) != "fsdp"


def dp_mechanism(config: ParallelConfig) -> str:
    """The data-parallel mechanism a config runs with: none | ddp | replicate | fsdp.

    Gradients are reduced over the dp * cp ranks that hold the same parameters (context
    parallel ranks hold whole layers, as torchtitan's ``dp_shard_cp`` mesh does), also when
    dp == 1. dp * cp == 1: none, unless state is offloaded: FSDP2 over the one rank then moves it
    to the host (ZeRO-Offload on one GPU). zero 0: DDP when tp == pp == 1, else ``replicate()``
    (DDP around tensor-parallel weights or pipeline stages is wrong on torch 2.13; see
    docs/runtime.md). zero >= 1: FSDP2 (HSDP when dp_replicate > 1). The runtime applies exactly
    this and the cost model charges it.
    """
    if config.data_ranks == 1 and config.offload == "none":
        return "none"
    if config.zero == 0:
        return "ddp" if config.pp == 1 and config.tp == 1 else "replicate"
    return "fsdp"


# The device mesh's axes, outermost first, tensor parallelism innermost (torchtitan's and
# Megatron-LM's order): the runtime builds this mesh (runtime/mesh.py) and the cost model places
# each group's ranks by it (cost_model/comm.parallel_groups). HSDP splits "dp" into
# (dp_replicate, dp_shard), replicas outermost.
MESH_AXES: tuple[str, str, str, str] = ("pp", "dp", "cp", "tp")


def mesh_strides(config: ParallelConfig) -> dict[str, int]:
    """Rank distance between neighbours along each axis of ``MESH_AXES`` (the product of the
    inner axes' sizes): rank r's coordinate on axis a is (r // stride[a]) % size[a]."""
    strides: dict[str, int] = {}
    inner = 1
    for axis in reversed(MESH_AXES):
        strides[axis] = inner
        inner *= getattr(config, axis)
    return strides
