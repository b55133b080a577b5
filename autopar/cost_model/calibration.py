"""Pure fits behind ``autopar calibrate`` and ``autopar verify --refit`` (no torch.distributed).

Units: seconds, bytes, FLOPs, bytes per second, FLOP/s.

Two linear "fixed cost plus rate" models, both fitted by least squares on relative error (weights
1 / t, because the sizes span four orders of magnitude and the small sizes would otherwise count
for nothing):

- collectives (alpha-beta; nccl-tests ``doc/PERFORMANCE.md``, reference/formulas.md section 6):
  ``t(S) = alpha + factor(op, n) * S / B`` where S is the buffer size in bytes, B the bus bandwidth
  and factor the collective's bus factor (all-reduce 2 (n - 1) / n, all-gather and reduce-scatter
  (n - 1) / n with S the full buffer, send/recv 1);
- matmul compute: ``t(F) = t0 + F / R`` where F = 2 m k n FLOPs, R the asymptotic achieved FLOP/s
  and t0 the fixed cost of one call. Achieved throughput ``F / t(F) = R * F / (F + t0 R)`` rises
  with size and saturates at R: the efficiency curve of the compute model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.cost_model.comm import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    SEND_RECV,
    ring_steps,
)

__all__ = [
    "Calibration",
    "CollectiveFit",
    "LinearFit",
    "base_preset",
    "calibration_to_cluster",
    "collective_time_factors",
    "compute_part_s",
    "fit_linear_relative",
    "median",
    "refit_cluster",
    "refit_scale",
    "relative_errors",
]



def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (mean of the middle two for an even count)."""
    if not values:
        raise ValueError("median of an empty sequence")
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearFit:
    """``t(x) = fixed_s + x / rate`` fitted on relative error.

    Attributes:
        fixed_s: the fixed cost of one call (alpha, or a matmul's t0), >= 0.
        rate: units of x per second (bus bytes/s, or FLOP/s), > 0.
        median_rel_error: median of |t_fit - t| / t over the samples.
        max_rel_error: largest of |t_fit - t| / t.
    """

    fixed_s: float
    rate: float
    median_rel_error: float
    max_rel_error: float

    def predict_s(self, x: float) -> float:
        """Fitted time of one call of size ``x``."""
        return self.fixed_s + x / self.rate


def _weighted_lstsq(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Minimise sum ((a + b x - t) / t)^2 over (a, b): the 2x2 normal equations."""
    w = [1.0 / (t * t) for t in ts]
    s_w = sum(w)
    s_x = sum(wi * x for wi, x in zip(w, xs))
    s_xx = sum(wi * x * x for wi, x in zip(w, xs))
    s_t = sum(wi * t for wi, t in zip(w, ts))
    s_xt = sum(wi * x * t for wi, x, t in zip(w, xs, ts))
    det = s_w * s_xx - s_x * s_x
    if det <= 0.0:
        raise ValueError("need samples at two or more distinct sizes to fit a line")
    a = (s_t * s_xx - s_x * s_xt) / det
    b = (s_w * s_xt - s_x * s_t) / det
    return a, b


def _slope_through_origin(xs: Sequence[float], ts: Sequence[float]) -> float:
    """Minimise sum ((b x - t) / t)^2 over b: b = sum(x/t) / sum((x/t)^2)."""
    r = [x / t for x, t in zip(xs, ts)]
    return sum(r) / sum(v * v for v in r)


def relative_errors(fit: LinearFit, xs: Sequence[float], ts: Sequence[float]) -> list[float]:
    """|fit(x) - t| / t for every sample."""
    return [abs(fit.predict_s(x) - t) / t for x, t in zip(xs, ts)]


def fit_linear_relative(xs: Sequence[float], ts: Sequence[float]) -> LinearFit:
    """Fit ``t = fixed + x / rate`` with fixed >= 0 and rate > 0, on relative error.

    When the unconstrained optimum has a negative intercept the fit is redone through the origin;
    when its slope is not positive (time does not grow with size, as on a loopback link whose
    small sizes are all latency) the rate is taken from the largest sample alone, after its fixed
    part.

    Args:
        xs: sizes (bus bytes, or FLOPs), at least two distinct values.
        ts: measured seconds per call, all > 0.

    Returns:
        The fit and its median and largest relative error over the samples.

    Raises:
        ValueError: fewer than two distinct sizes, or a non-positive or non-finite time.
    """
    if len(xs) != len(ts) or len(set(xs)) < 2:
        raise ValueError("need samples at two or more distinct sizes to fit a line")
    if any(not (math.isfinite(t) and t > 0.0) for t in ts):
        raise ValueError("every measured time must be positive and finite")
    a, b = _weighted_lstsq(xs, ts)
    if a < 0.0:
        a, b = 0.0, _slope_through_origin(xs, ts)
    if b <= 0.0:
        i = max(range(len(xs)), key=lambda j: xs[j])
        a = min(ts)
        b = max(ts[i] - a, 1e-3 * ts[i]) / xs[i]
    fit = LinearFit(fixed_s=a, rate=1.0 / b, median_rel_error=0.0, max_rel_error=0.0)
    errors = relative_errors(fit, xs, ts)
    return LinearFit(
        fixed_s=a, rate=1.0 / b, median_rel_error=median(errors), max_rel_error=max(errors)
    )


def refit_scale(
    predicted_part_s: float, measured_total_s: float, predicted_total_s: float
) -> float:
    """Factor to divide the time of one cost term by so the prediction meets the measurement.

    The prediction is ``other + part``; the measurement says the step took ``measured``. Keeping
    the other terms, the part should have taken ``part' = measured - other``, so a throughput-like
    parameter of that term (an efficiency, a bandwidth) is multiplied by ``part / part'``. The new
    part is clamped to at least 5% of the old one (the other terms are themselves only estimates,
    and a measurement below them must not drive the part to zero or below).

    Args:
        predicted_part_s: the predicted seconds of the term being refitted (> 0).
        measured_total_s: the measured step time.
        predicted_total_s: the predicted step time (including the part).

    Returns:
        The multiplier for the term's throughput parameter: > 1 when the run was faster than
        predicted, < 1 when it was slower, 1 when they agree.

    Raises:
        ValueError: a non-positive part or time.
    """
    if predicted_part_s <= 0.0 or measured_total_s <= 0.0 or predicted_total_s <= 0.0:
        raise ValueError("times must be positive to refit")
    other_s = predicted_total_s - predicted_part_s
    wanted_s = max(measured_total_s - other_s, 0.05 * predicted_part_s)
    return predicted_part_s / wanted_s


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveFit:
    """One collective's alpha-beta fit over the whole group.

    Attributes:
        op: collective name (see ``COLLECTIVES``).
        group_size: ranks in the group (2 for send/recv).
        latency_s: alpha, the fixed cost of one call.
        bandwidth_bytes_per_s: B, bus bandwidth (bytes moved per rank per second).
        median_rel_error: median |fit - measured| / measured over the sizes.
        max_rel_error: largest of the same.
        samples: (buffer bytes, median seconds per call) per size.
    """

    op: str
    group_size: int
    latency_s: float
    bandwidth_bytes_per_s: float
    median_rel_error: float
    max_rel_error: float
    samples: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """Everything ``calibrate`` measured and fitted.

    Attributes:
        device_type: "cpu" or "cuda".
        nproc: processes that ran concurrently (one per device).
        dtype: matmul dtype ("fp32" on CPU, "bf16" on GPU).
        matmul_samples: (m, k, n, seconds per call) per shape.
        matmul_fixed_s: t0, the fixed cost of one matmul call.
        matmul_peak_flops: R, the achieved FLOP/s of large matmuls (per process).
        matmul_median_rel_error: median relative error of the matmul fit.
        collectives: one fit per collective and group size (empty when nproc == 1); with 4 or
            more processes also all_reduce in concurrent pairs (group size 2).
        op_overhead_s: framework seconds per dispatched aten op (eager, forward + backward).
        layer_overhead_s: seconds of one transformer block's forward + backward at a tiny width.
        dtensor_layer_overhead_s: extra seconds per block when its linears are DTensors (TP).
        fsdp_layer_overhead_s: extra seconds per block under FSDP2 ``fully_shard``.
        nonblock_overhead_s: seconds of the rest of a one-block tiny model's forward + backward
            (embedding, final norm, head, loss).
        dtensor_module_overhead_s: ``dtensor_layer_overhead_s`` per tensor-parallel module.
        optimizer_layer_overhead_s: seconds of one AdamW step over a tiny block's parameters.
        optimizer_nonblock_overhead_s: the same over the rest of the tiny model.
        dtensor_optimizer_layer_overhead_s: extra seconds of that step when the block's
            parameters are DTensors (TP or FSDP2).
        cpu_cores: CPU cores the processes could run on (0: not recorded).
        recompute_layer_overhead_s: extra seconds of a block's forward + backward under
            non-reentrant activation checkpointing (the re-run forward included).
        memory_bytes_per_s: bytes read + written per second by a large tensor copy (per process).
        wall_s: wall time of the measurement, process start included.
        device_name: the device's name ("cpu", or what CUDA reports, e.g. "NVIDIA H200").
    """

    device_type: str
    nproc: int
    dtype: str
    matmul_samples: tuple[tuple[int, int, int, float], ...]
    matmul_fixed_s: float
    matmul_peak_flops: float
    matmul_median_rel_error: float
    collectives: tuple[CollectiveFit, ...]
    op_overhead_s: float
    layer_overhead_s: float
    dtensor_layer_overhead_s: float
    fsdp_layer_overhead_s: float
    memory_bytes_per_s: float
    wall_s: float
    device_name: str = "cpu"
    nonblock_overhead_s: float = 0.0
    dtensor_module_overhead_s: float = 0.0
    optimizer_layer_overhead_s: float = 0.0
    optimizer_nonblock_overhead_s: float = 0.0
    dtensor_optimizer_layer_overhead_s: float = 0.0
    cpu_cores: int = 0
    recompute_layer_overhead_s: float = 0.0

    def collective(self, op: str, group_size: int | None = None) -> CollectiveFit:
        """The fit of collective ``op`` (over ``group_size`` ranks, default the largest group).

        Raises:
            KeyError: the collective was not measured (at that group size).
        """
        fits = [f for f in self.collectives
                if f.op == op and (group_size is None or f.group_size == group_size)]
        if not fits:
            raise KeyError(op)
        return max(fits, key=lambda f: f.group_size)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples as lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """Inverse of ``to_dict``."""
        data = dict(data)
        data["matmul_samples"] = tuple(tuple(s) for s in data["matmul_samples"])
        data["collectives"] = tuple(
            CollectiveFit(**{**c, "samples": tuple(tuple(s) for s in c["samples"])})
            for c in data["collectives"]
        )
        return cls(**data)


def base_preset(calibration: Calibration) -> str:
    """The preset whose datasheet figures a calibration starts from, by device name."""
    if calibration.device_type == "cpu":
        return "cpu"
    from autopar.cost_model.presets import preset_for_device_name

    return preset_for_device_name(calibration.device_name)


def calibration_to_cluster(calibration: Calibration, base: Any = None) -> Any:
    """A Cluster of one node of ``calibration.nproc`` devices with the measured figures.

    What changes from ``base`` (the other fields, memory and headroom included, are kept):

    - ``device.matmul_efficiency_max = R / peak(dtype)``, with R the fitted large-matmul rate;
      when R exceeds the stated peak the peak is raised to R (efficiency 1);
    - on CPU (synchronous: host costs add to the arithmetic) the framework overheads go into
      their own fields, charged per layer by ``compute.framework_overheads_s``:
      ``layer_overhead_s`` (a tiny block's forward + backward), ``edge_layer_overhead_s``
      (half the rest of a one-block model), ``tp_module_overhead_s`` (DTensor's extra per
      tensor-parallel module), ``fsdp_layer_overhead_s``, ``optimizer_layer_overhead_s`` and
      ``dtensor_optimizer_layer_overhead_s``; ``matmul_half_flops = R * t0`` (one call's own
      fixed cost); ``shared_compute_processes = max(1, nproc / cpu_cores)``;
    - on GPU (the host runs ahead of the kernels) ``dispatch_floor_s = layer_overhead_s``: a
      block takes at least the measured host cost of a tiny block's forward + backward, which
      shows only when its kernels are shorter (``compute.layer_compute``);
    - ``device.hbm_bytes_per_s``: the measured copy bandwidth;
    - both link tiers: bandwidth = median of the fitted bus bandwidths of all_reduce (every
      group size measured), all_gather_into_tensor and reduce_scatter_tensor; latency per ring
      step = median over those of alpha / ring_steps (hardware.py: link latency is per ring
      step).

    Args:
        calibration: what ``calibrate`` measured.
        base: the cluster to start from (default: ``Cluster.preset("cpu", gpus_per_node=nproc)``
            on CPU, the preset of the GPU's name on GPU, ``base_preset``).

    Returns:
        The new Cluster, named ``calibrated-<device_type>``.
    """
    from autopar.cost_model.hardware import Cluster

    cal = calibration
    if base is None:
        base = Cluster.preset(base_preset(cal), gpus_per_node=cal.nproc)
    data = base.to_dict()
    data.update(name=f"calibrated-{cal.device_type}", nodes=1, gpus_per_node=cal.nproc)
    _measured_device(data["device"], cal)
    fits = [c for c in cal.collectives if c.op != SEND_RECV]
    if fits:
        data.update(_measured_links(fits))
    return Cluster.from_dict(data)


def _measured_device(device: dict[str, Any], cal: Calibration) -> None:
    """Write the calibration's compute figures into a cluster dict's ``device`` section."""
    peak_key = f"peak_{cal.dtype}_flops"
    rate = cal.matmul_peak_flops
    if rate > device[peak_key]:
        device[peak_key] = rate
    device["matmul_efficiency_max"] = rate / device[peak_key]
    device["hbm_bytes_per_s"] = cal.memory_bytes_per_s
    if cal.device_type == "cpu":
        # Synchronous execution: the framework's fixed costs add to the arithmetic, so they are
        # charged per layer (compute.framework_overheads_s) and the matmul curve keeps only a
        # call's own fixed cost t0 (half efficiency at F = t0 R).
        device["matmul_half_flops"] = rate * cal.matmul_fixed_s
        device.update(
            layer_overhead_s=cal.layer_overhead_s,
            # Measured for the embedding and the head together: half each.
            edge_layer_overhead_s=0.5 * cal.nonblock_overhead_s,
            tp_module_overhead_s=cal.dtensor_module_overhead_s,
            fsdp_layer_overhead_s=cal.fsdp_layer_overhead_s,
            optimizer_layer_overhead_s=cal.optimizer_layer_overhead_s,
            dtensor_optimizer_layer_overhead_s=cal.dtensor_optimizer_layer_overhead_s,
            recompute_layer_overhead_s=cal.recompute_layer_overhead_s,
        )
        if cal.cpu_cores > 0:  # workers beyond the cores take turns on them
            device["shared_compute_processes"] = max(1.0, cal.nproc / cal.cpu_cores)
    else:
        # The host dispatches ahead of the kernels: its cost shows only when a block's kernels
        # are shorter, which the dispatch floor expresses (a tiny block's measured forward +
        # backward is the host's time per block); the matmul curve keeps the preset's half-work
        # point, measured on real blocks (benchmarks/gpu_layer.py).
        device["dispatch_floor_s"] = cal.layer_overhead_s


def _measured_links(fits: Sequence[CollectiveFit]) -> dict[str, Any]:
    """Both link tiers and the collectives' time factors from the fitted collectives."""
    link = {
        "bandwidth_bytes_per_s": median([c.bandwidth_bytes_per_s for c in fits]),
        "latency_s": median([c.latency_s / ring_steps(c.op, c.group_size) for c in fits]),
    }
    return {"intra_node": dict(link), "inter_node": dict(link),
            **collective_time_factors(fits, link)}


# Calibration op -> the Cluster field of its measured-over-modelled time factor.
_TIME_FACTOR_FIELDS = {
    ALL_REDUCE: "all_reduce_time_factor",
    ALL_GATHER: "all_gather_time_factor",
    REDUCE_SCATTER: "reduce_scatter_time_factor",
}


def collective_time_factors(fits: Sequence[Any], link: dict[str, float]) -> dict[str, float]:
    """Per collective kind: median over its samples of measured time / ring-model time on
    ``link`` (``comm``'s formulas: (n - 1)/n S/B + (n - 1) alpha, twice for all-reduce).

    One link (the median bandwidth and per-step latency of all kinds) cannot express that a
    library runs some kinds with other algorithms (gloo's reduce-scatter measured about twice
    the ring model on this machine); the factor carries the rest.
    """
    ratios: dict[str, list[float]] = {}
    for fit in fits:
        field = _TIME_FACTOR_FIELDS.get(fit.op)
        n = fit.group_size
        if field is None or n <= 1:
            continue
        for size, seconds in fit.samples:
            model = ring_steps(fit.op, n) * (
                link["latency_s"] + size / n / link["bandwidth_bytes_per_s"])
            if model > 0 and seconds > 0:
                ratios.setdefault(field, []).append(seconds / model)
    return {field: median(values) for field, values in sorted(ratios.items())}


def compute_part_s(time_breakdown: dict[str, float]) -> float:
    """The seconds of a step the compute parameters govern: compute, recompute and bubble.

    The pipeline bubble is idle time proportional to the stages' per-micro-batch times, which
    are mostly compute on the runs the refit is for.
    """
    return sum(time_breakdown.get(k, 0.0) for k in ("compute_s", "recompute_s", "bubble_s"))


def refit_cluster(cluster: Any, time_breakdown: dict[str, float], measured_step_s: float) -> Any:
    """Rescale a cluster's compute throughput so a predicted step meets the measured one.

    With ``s = refit_scale(compute part, measured, predicted)``, the achieved matmul rate
    ``R = peak * matmul_efficiency_max`` and the memory bandwidth ``hbm_bytes_per_s`` are both
    multiplied by s (``matmul_half_flops`` is kept, so the fixed per-layer part ``half / R`` also
    scales by 1 / s): every compute-derived time of the cost model then scales by 1 / s and the
    other terms (communication, optimizer) are unchanged. When ``s R`` exceeds the device's stated
    peak at every dtype, the peaks are raised to it (efficiency 1).

    Args:
        cluster: the Cluster the prediction was made on.
        time_breakdown: the prediction's ``TimeBreakdown.to_dict()`` (its terms sum to the step).
        measured_step_s: the measured step time.

    Returns:
        The refitted Cluster (same name with "-refit" appended once).

    Raises:
        ValueError: a prediction without compute time, or a non-positive measurement.
    """
    from autopar.cost_model.hardware import Cluster

    predicted_s = sum(time_breakdown.values())
    scale = refit_scale(compute_part_s(time_breakdown), measured_step_s, predicted_s)
    data = cluster.to_dict()
    device = data["device"]
    eff = device["matmul_efficiency_max"] * scale
    if eff > 1.0:
        for key in ("peak_bf16_flops", "peak_fp16_flops", "peak_tf32_flops", "peak_fp32_flops"):
            device[key] *= eff
        eff = 1.0
    device["matmul_efficiency_max"] = eff
    device["hbm_bytes_per_s"] *= scale
    if not data["name"].endswith("-refit"):
        data["name"] = f"{data['name']}-refit"
    return Cluster.from_dict(data)
