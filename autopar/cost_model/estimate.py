"""Estimate: the predicted time and memory of one split, with breakdowns a person can read.

Units: seconds, bytes, FLOP/s. ``tokens_per_s`` is for the whole job (all GPUs);
``tflops_per_gpu`` and ``mfu`` count model FLOPs (recomputation excluded);
``hardware_tflops_per_gpu`` counts what is executed (recomputation included).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autopar.cost_model.framework_names import DEFAULT_FRAMEWORK

__all__ = ["Estimate", "MemoryBreakdown", "StageEstimate", "TimeBreakdown"]


def _sum_of_fields(record: Any) -> float:
    """The sum of a breakdown's terms, added left to right in field order (every field a term)."""
    total = 0.0
    for term in dataclasses.fields(record):
        total += getattr(record, term.name)
    return total


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeBreakdown:
    """Where one step's time goes, in seconds (on the critical path: exposed, not total).

    Attributes:
        compute_s: model forward + backward compute (pipeline steady state, bottleneck rank).
        recompute_s: re-run forward compute for activation recomputation.
        tp_comm_s: exposed tensor-parallel collectives (all-reduce, or RS + AG with SP).
        pp_comm_s: exposed pipeline point-to-point sends.
        dp_comm_s: exposed data-parallel gradient reduction and ZeRO parameter gathers.
        bubble_s: pipeline fill and drain.
        optimizer_s: optimizer step.
        overhead_s: the framework's fixed per-step cost outside the layers (data loading,
            gradient clipping, optimizer launch, logging).
        ep_comm_s: exposed expert-parallel all-to-all (token dispatch and combine).
        cp_comm_s: exposed ring-attention K/V exchange of context parallelism.
    """

    compute_s: float = 0.0
    recompute_s: float = 0.0
    tp_comm_s: float = 0.0
    pp_comm_s: float = 0.0
    dp_comm_s: float = 0.0
    bubble_s: float = 0.0
    optimizer_s: float = 0.0
    overhead_s: float = 0.0
    ep_comm_s: float = 0.0
    cp_comm_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Sum of the terms (equals the step time)."""
        return _sum_of_fields(self)

    def to_dict(self) -> dict[str, float]:
        """JSON-ready dict (no ``ep_comm_s`` key without expert parallelism)."""
        data = dataclasses.asdict(self)
        if not data["ep_comm_s"]:
            del data["ep_comm_s"]
        return data


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Peak memory of one rank by kind, in bytes.

    Attributes:
        parameters_bytes: parameters held (training dtype; sharded by tp, pp, and ZeRO-3).
        gradients_bytes: gradients held (sharded by ZeRO-2/3 as the runtime does).
        optimizer_bytes: optimizer state: fp32 master weights and Adam moments (ZeRO-1+ shards).
        activations_bytes: saved activations of the in-flight micro-batches, plus the transient
            working set of the largest layer.
        buffers_bytes: communication buffers, allocator reserve, ZeRO-3 gather buffers.
        pipeline_buffers_bytes: torch pipelining's per-micro-batch receive buffers (stage
            inputs, output gradients) and the input gradients the split backward keeps on
            them, held through the step (``pipeline.pipeline_buffer_microbatches``).
    """

    parameters_bytes: float = 0.0
    gradients_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activations_bytes: float = 0.0
    buffers_bytes: float = 0.0
    pipeline_buffers_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        """Sum of the terms."""
        return _sum_of_fields(self)

    def to_dict(self) -> dict[str, float]:
        """JSON-ready dict."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageEstimate:
    """Per pipeline rank figures.

    Attributes:
        rank: pipeline rank (0 .. pp-1).
        stages: model-chunk indices this rank holds (one unless interleaved).
        layers: (first, last) profile-layer index of each chunk, inclusive.
        num_params: parameters this rank's chunks hold before tp/ZeRO sharding.
        time_per_microbatch_s: forward + backward (+ recompute, exposed comm) of one micro-batch.
        memory: this rank's peak memory by kind.
    """

    rank: int
    stages: tuple[int, ...]
    layers: tuple[tuple[int, int], ...]
    num_params: int
    time_per_microbatch_s: float
    memory: MemoryBreakdown

    @property
    def memory_bytes(self) -> float:
        """Peak memory of the rank."""
        return self.memory.total_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "rank": self.rank,
            "stages": list(self.stages),
            "layers": [list(r) for r in self.layers],
            "num_params": self.num_params,
            "time_per_microbatch_s": self.time_per_microbatch_s,
            "memory": self.memory.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageEstimate:
        """Inverse of ``to_dict``."""
        return cls(
            rank=data["rank"],
            stages=tuple(data["stages"]),
            layers=tuple(tuple(r) for r in data["layers"]),
            num_params=data["num_params"],
            time_per_microbatch_s=data["time_per_microbatch_s"],
            memory=MemoryBreakdown(**data["memory"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """Predicted figures of one split on one cluster.

    Attributes:
        step_time_s: one optimizer step.
        tokens_per_s: tokens per second for the whole job.
        tflops_per_gpu: model TFLOP/s per GPU (recompute excluded).
        hardware_tflops_per_gpu: executed TFLOP/s per GPU (recompute included).
        mfu: model FLOPs utilisation, a fraction of the device's peak at the training dtype
            (its 16-bit peak for fp8, whose linears run faster: Megatron-LM's and torchtitan's
            convention; ``config.base_dtype``).
        memory_per_gpu_bytes: the largest rank's predicted peak memory.
        memory_capacity_bytes: usable device memory (device memory minus the cluster's headroom).
        fits: memory_per_gpu_bytes <= memory_capacity_bytes.
        time_breakdown: the step time by term.
        memory_breakdown: the largest rank's memory by kind.
        stages: per pipeline-rank figures.
        binding: what limits the split most, in words (e.g. "memory of pipeline rank 0").
        framework: the training framework the prediction is for.
        step_time_interval_s: (low, high) step time that holds 80% of the framework's
            cross-validated outcomes (``Framework.step_time_band`` around ``step_time_s``).
        host_memory_per_gpu_bytes: host memory the largest rank's offloaded state and
            host-kept activation checkpoints need.
        host_memory_capacity_bytes: host memory per GPU of the cluster; ``fits`` needs both
            the device and the host memory to fit.
        precision: the training precision and why, in words.
    """

    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    memory_per_gpu_bytes: float
    memory_capacity_bytes: float
    fits: bool
    time_breakdown: TimeBreakdown
    memory_breakdown: MemoryBreakdown
    stages: tuple[StageEstimate, ...] = ()
    binding: str = ""
    framework: str = DEFAULT_FRAMEWORK
    step_time_interval_s: tuple[float, float] = (0.0, 0.0)
    host_memory_per_gpu_bytes: float = 0.0
    host_memory_capacity_bytes: float = 0.0
    precision: str = ""

    @property
    def tokens_per_s_interval(self) -> tuple[float, float]:
        """(low, high) tokens per second matching ``step_time_interval_s``."""
        low_s, high_s = self.step_time_interval_s
        per_step = self.tokens_per_s * self.step_time_s
        return (per_step / high_s if high_s else 0.0, per_step / low_s if low_s else 0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (nested records as dicts)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data.update(
            time_breakdown=self.time_breakdown.to_dict(),
            memory_breakdown=self.memory_breakdown.to_dict(),
            stages=[s.to_dict() for s in self.stages],
            step_time_interval_s=list(self.step_time_interval_s),
        )
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Estimate:
        """Inverse of ``to_dict``."""
        data = dict(data)
        data["time_breakdown"] = TimeBreakdown(**data["time_breakdown"])
        data["memory_breakdown"] = MemoryBreakdown(**data["memory_breakdown"])
        data["stages"] = tuple(StageEstimate.from_dict(s) for s in data.get("stages", ()))
        if "step_time_interval_s" in data:
            low, high = data["step_time_interval_s"]
            data["step_time_interval_s"] = (float(low), float(high))
        return cls(**data)
