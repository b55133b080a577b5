"""``autopar verify``: run a plan for a few steps and compare what ran with what was predicted.

The plan runs through the launcher of ``autopar run`` (torchrun; gloo on CPU, NCCL on GPU) on the
seeded synthetic data. Measured:

- step time: the median of the slowest rank's step wall time over the steps after the warm-up
  (the first steps build buffers, warm caches and, on GPU, select kernels);
- peak memory: every rank's peak of live tensor bytes (CPU: every storage the run creates,
  counted exactly while alive; GPU: ``torch.cuda.max_memory_allocated``), shown for the largest
  rank and per global rank beside that rank's prediction (the prediction of its pipeline rank:
  every dp x tp rank at one pp coordinate of the mesh holds the same chunks).

Predicted: ``autopar.estimate(profile, cluster, plan)`` on the given cluster (``--cluster``), or
on the cluster the plan carries. Errors are signed and relative to the measurement:
``(predicted - measured) / measured``. The command (``autopar/cli/cmd_verify.py``) with
``--refit`` rescales the cluster's compute efficiency so that the prediction meets the measured
step time (``autopar.cost_model.calibration.refit_cluster``) and writes the new cluster as YAML.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.cost_model.calibration import median
from autopar.errors import AutoparError
from autopar.units import MIB

__all__ = [
    "RankMemory",
    "Verification",
    "format_rank_table",
    "format_verification",
    "measure_plan",
    "model_profile",
    "per_rank_memory",
    "pp_rank_of",
    "predict",
    "verify_plan",
]


# Rows of the per-rank memory table; the ranks after these are summed up in one line.
MAX_RANK_ROWS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """What one short run of a plan measured.

    Attributes:
        step_times_s: the slowest rank's wall time of every step, in order.
        warmup_steps: leading steps left out of the median.
        peak_memory_bytes: the largest rank's peak of live tensor bytes.
        losses: the loss of every step.
        peak_memory_bytes_per_rank: every rank's peak of live tensor bytes, global rank order.
    """

    step_times_s: tuple[float, ...]
    warmup_steps: int
    peak_memory_bytes: int
    losses: tuple[float, ...]
    peak_memory_bytes_per_rank: tuple[int, ...] = ()

    @property
    def step_time_s(self) -> float:
        """Median step time after the warm-up."""
        return median(self.step_times_s[self.warmup_steps:])


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    """One global rank's predicted and measured peak memory.

    Attributes:
        rank: global rank.
        pp_rank: the rank's pipeline rank (its coordinate on the mesh's "pp" axis).
        predicted_bytes: the cost model's peak for that pipeline rank (headroom excluded).
        measured_bytes: the rank's measured peak of live tensor bytes.
    """

    rank: int
    pp_rank: int
    predicted_bytes: float
    measured_bytes: int

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured; None when the rank measured nothing."""
        if self.measured_bytes <= 0:
            return None
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (error included)."""
        return {"rank": self.rank, "pp_rank": self.pp_rank,
                "predicted_bytes": self.predicted_bytes, "measured_bytes": self.measured_bytes,
                "error": self.error}


@dataclass(frozen=True, slots=True, kw_only=True)
class Verification:
    """A plan's prediction beside its measurement.

    Attributes:
        config: the plan's ParallelConfig as a dict.
        predicted_step_time_s: the cost model's step time on the cluster.
        measured_step_time_s: median measured step time after the warm-up.
        predicted_memory_bytes: the cost model's largest per-rank memory (headroom excluded).
        measured_memory_bytes: the largest rank's measured peak of live tensor bytes.
        measurement: the raw measurement.
        estimate: the Estimate as a dict (its time and memory breakdowns).
        cluster_name: the name of the cluster the prediction is for.
        per_rank: every global rank's predicted and measured peak memory, in rank order.
    """

    config: dict[str, Any]
    predicted_step_time_s: float
    measured_step_time_s: float
    predicted_memory_bytes: float
    measured_memory_bytes: int
    measurement: Measurement
    estimate: dict[str, Any]
    cluster_name: str
    per_rank: tuple[RankMemory, ...] = ()

    @property
    def predicted_memory_bytes_per_rank(self) -> tuple[float, ...]:
        """Predicted peak of every global rank."""
        return tuple(r.predicted_bytes for r in self.per_rank)

    @property
    def measured_memory_bytes_per_rank(self) -> tuple[int, ...]:
        """Measured peak of every global rank."""
        return tuple(r.measured_bytes for r in self.per_rank)

    @property
    def memory_errors_per_rank(self) -> tuple[float | None, ...]:
        """(predicted - measured) / measured of every global rank (None: nothing measured)."""
        return tuple(r.error for r in self.per_rank)

    @property
    def step_time_error(self) -> float:
        """(predicted - measured) / measured step time."""
        return (self.predicted_step_time_s - self.measured_step_time_s) / self.measured_step_time_s

    @property
    def memory_error(self) -> float:
        """(predicted - measured) / measured peak memory (0 when nothing was measured)."""
        if self.measured_memory_bytes <= 0:
            return 0.0
        return (self.predicted_memory_bytes - self.measured_memory_bytes) / (
            self.measured_memory_bytes
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (errors included)."""
        return {
            "config": self.config,
            "cluster": self.cluster_name,
            "predicted_step_time_s": self.predicted_step_time_s,
            "measured_step_time_s": self.measured_step_time_s,
            "step_time_error": self.step_time_error,
            "predicted_memory_bytes": self.predicted_memory_bytes,
            "measured_memory_bytes": self.measured_memory_bytes,
            "memory_error": self.memory_error,
            "step_times_s": list(self.measurement.step_times_s),
            "warmup_steps": self.measurement.warmup_steps,
            "losses": list(self.measurement.losses),
            "estimate": self.estimate,
            "per_rank": [r.to_dict() for r in self.per_rank],
        }


def pp_rank_of(rank: int, config: dict[str, Any]) -> int:
    """The pipeline rank of global rank ``rank`` on the runtime's mesh.

    ``runtime/mesh.py`` builds the mesh with ``init_device_mesh`` over shape (pp, dp, tp) in the
    axis order ``MESH_AXES``, outermost first, so ranks are laid out row-major: the innermost axis
    varies fastest. Peeling the axes off from the innermost gives the rank's coordinates; with
    ("pp", "dp", "tp") the pipeline rank is ``rank // (dp * tp)``.

    Args:
        rank: global rank (0 .. pp * dp * tp - 1).
        config: the plan's ParallelConfig as a dict (``dp``, ``tp``, ``pp``).

    Raises:
        ValueError: ``rank`` is outside the mesh.
    """
    from autopar.runtime.mesh import MESH_AXES

    degrees = [int(config.get(axis, 1)) for axis in MESH_AXES]
    world_size = 1
    for degree in degrees:
        world_size *= degree
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a mesh of {world_size} ranks")
    coordinates: dict[str, int] = {}
    for axis, degree in zip(reversed(MESH_AXES), reversed(degrees), strict=True):
        coordinates[axis] = rank % degree
        rank //= degree
    return coordinates["pp"]


def per_rank_memory(config: dict[str, Any], estimate: dict[str, Any],
                    measured_bytes_per_rank: tuple[int, ...]) -> tuple[RankMemory, ...]:
    """Pair every global rank's measured peak with its pipeline rank's predicted peak.

    Args:
        config: the plan's ParallelConfig as a dict.
        estimate: the Estimate as a dict; ``stages[i]["memory"]`` are the byte terms of pipeline
            rank ``stages[i]["rank"]``. Without stages every rank gets ``memory_per_gpu_bytes``.
        measured_bytes_per_rank: the measured peaks in global rank order.
    """
    by_pp_rank = {int(st["rank"]): float(sum(st["memory"].values()))
                  for st in estimate.get("stages", ())}
    fallback = float(estimate.get("memory_per_gpu_bytes", 0.0))
    rows = []
    for rank, measured in enumerate(measured_bytes_per_rank):
        pp_rank = pp_rank_of(rank, config)
        rows.append(RankMemory(rank=rank, pp_rank=pp_rank,
                               predicted_bytes=by_pp_rank.get(pp_rank, fallback),
                               measured_bytes=int(measured)))
    return tuple(rows)


def measure_plan(plan: Any, model_text: str, *, steps: int, warmup_steps: int,
                 seed: int = 0) -> Measurement:
    """Run ``plan`` for ``steps`` steps with the launcher of ``autopar run`` and measure it.

    Args:
        plan: the Plan.
        model_text: how to rebuild the model (as ``autopar run`` takes it).
        steps: steps to run (> warmup_steps).
        warmup_steps: leading steps left out of the step-time median.
        seed: seed of the weights and data.

    Returns:
        The measurement.

    Raises:
        AutoparError: too few steps, or the workers failed.
    """
    import torch

    from autopar.graph.profiler import short_logits_refused
    from autopar.runtime.launch import PG_TIMEOUT_S, launch, launch_spec_for
    from autopar.runtime.worker import WorkerArgs, pipeline_batch_problem

    if warmup_steps < 0 or steps <= warmup_steps:
        raise AutoparError(
            f"--steps ({steps}) must exceed --warmup ({warmup_steps}) so some steps are timed"
        )
    with short_logits_refused():  # what the workers would fail on, before they start
        profile = model_profile(model_text, seq_len=plan.seq_len or None)
    problem = pipeline_batch_problem(model_text, profile, plan.config.pp)
    if problem:
        raise AutoparError(problem)
    spec = launch_spec_for(world_size=plan.config.world_size, nnodes=1, node_rank=0,
                           rdzv_endpoint="", nproc_per_node=None, max_restarts=0)
    args = WorkerArgs(
        plan=plan.to_dict(), model=model_text, steps=steps, seed=seed, checkpoint_dir="",
        checkpoint_every=0, seq_len=profile.seq_len, vocab=profile.vocab, result_path="",
        device_type="cuda" if torch.cuda.is_available() else "cpu", pg_timeout_s=PG_TIMEOUT_S,
    )
    result = launch(args, spec)
    if result.returncode != 0 or not result.finished or len(result.step_times_s) != steps:
        raise AutoparError(
            f"the plan's workers failed (torchrun exit code {result.returncode}); see the log "
            "above, or run it with `autopar run` to reproduce"
        )
    if len(result.peak_memory_bytes_per_rank) != plan.config.world_size:
        raise AutoparError(
            f"the workers reported {len(result.peak_memory_bytes_per_rank)} per-rank memory "
            f"peaks for {plan.config.world_size} ranks"
        )
    return Measurement(step_times_s=tuple(result.step_times_s), warmup_steps=warmup_steps,
                       peak_memory_bytes=int(result.peak_memory_bytes),
                       losses=tuple(result.losses),
                       peak_memory_bytes_per_rank=tuple(result.peak_memory_bytes_per_rank))


def model_profile(model_text: str, dtype: str | None = None, kernels: str = "cuda",
                  seq_len: int | None = None) -> Any:
    """Build ``model_text`` on the meta device (as ``autopar run`` builds it) and profile it.

    Args:
        model_text: ``gpt:layers=...``, a zoo preset, a ``.py`` model file, an HF config JSON.
        dtype: the dtype the profile counts bytes at (default: ``autopar.profile``'s, as
            ``autopar plan`` uses).
        kernels: whose kernels' saved tensors to count ("cuda", as ``autopar plan``, or "cpu").
        seq_len: tokens a sequence (default: the model's own; a plan's ``seq_len``, as
            ``autopar plan --seq-len`` made it).
    """
    from autopar.graph.model_text import build_and_profile

    return build_and_profile(model_text, seq_len=seq_len, dtype=dtype, kernels=kernels)[1]


def predict(plan: Any, model_text: str, cluster: Any) -> Any:
    """``autopar.estimate`` of the plan on ``cluster`` (the model re-profiled from its text).

    The model is profiled as ``autopar plan`` does, or else at the plan's training dtype, whichever
    matches the plan's profile fingerprint.

    Raises:
        PlanMismatchError: the plan was made for another model.
    """
    import torch

    from autopar.costing import estimate

    dtype, seq_len = None, plan.seq_len or None
    profile = model_profile(model_text, seq_len=seq_len)
    if not plan.profile_matches(profile):
        dtype = plan.config.dtype
        profile = model_profile(model_text, dtype, seq_len=seq_len)
    plan.check_profile(profile, fix=f"re-plan with `autopar plan` for {model_text}")
    if not torch.cuda.is_available():
        # The run happens on CPU: count the saved tensors of torch's CPU kernels (an unfused
        # RMSNorm also keeps its normalised input; autopar/graph/profiler.py ``kernels``).
        profile = model_profile(model_text, dtype, kernels="cpu", seq_len=seq_len)
        # The same model (checked above), counted as the CPU kernels keep it: estimated so.
        plan = plan.for_profile(profile)
    # --cluster predicts the plan's split on another cluster of the same size on purpose.
    return estimate(profile, cluster, plan.for_cluster(cluster))


def verify_plan(plan: Any, cluster: Any, *, model_text: str = "", steps: int = 6,
                warmup_steps: int = 2, seed: int = 0) -> Verification:
    """Predict and measure one plan.

    Args:
        plan: the Plan.
        cluster: the Cluster to predict on (e.g. the output of ``autopar calibrate``).
        model_text: the model (default: the plan's own ``model`` field, unless it is a ``.py``
            file: a model file named by a plan runs only when given here).
        steps: steps to run, warm-up included.
        warmup_steps: leading steps not timed.
        seed: seed of the weights and data.

    Returns:
        The prediction beside the measurement.
    """
    from autopar.graph.model_text import plan_model_text

    model_text = plan_model_text(plan.model, model_text)
    estimate = predict(plan, model_text, cluster)
    measured = measure_plan(plan, model_text, steps=steps, warmup_steps=warmup_steps, seed=seed)
    config = plan.config.to_dict()
    estimate_dict = estimate.to_dict()
    return Verification(
        config=config,
        predicted_step_time_s=estimate.step_time_s,
        measured_step_time_s=measured.step_time_s,
        predicted_memory_bytes=_predicted_memory(estimate),
        measured_memory_bytes=measured.peak_memory_bytes,
        measurement=measured,
        estimate=estimate_dict,
        cluster_name=cluster.name,
        per_rank=per_rank_memory(config, estimate_dict, measured.peak_memory_bytes_per_rank),
    )


def _predicted_memory(estimate: Any) -> float:
    """Largest rank's predicted peak (the Estimate's figure, which excludes the headroom)."""
    return float(estimate.memory_per_gpu_bytes)


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def format_verification(v: Verification) -> str:
    """The prediction beside the measurement, as a short table, then the per-rank memory table."""
    m = v.measurement
    timed = len(m.step_times_s) - m.warmup_steps
    tb = v.estimate.get("time_breakdown", {})
    terms = ", ".join(f"{k.removesuffix('_s')} {t * 1e3:.1f}" for k, t in tb.items() if t > 0)
    per_pp_rank = ", ".join(
        f"pp rank {st['rank']} {sum(st['memory'].values()) / MIB:.2f}"
        for st in v.estimate.get("stages", ())
    )
    return (
        f"autopar verify: {_split_text(v.config)} on cluster {v.cluster_name}\n"
        f"                   predicted     measured    error\n"
        f"  step time      {v.predicted_step_time_s * 1e3:9.2f} ms "
        f"{v.measured_step_time_s * 1e3:9.2f} ms  {_percent(v.step_time_error):>7s}"
        f"   (median of {timed} steps after {m.warmup_steps} warm-up)\n"
        f"  peak memory    {v.predicted_memory_bytes / MIB:9.2f} MiB"
        f"{v.measured_memory_bytes / MIB:9.2f} MiB {_percent(v.memory_error):>7s}"
        f"   (largest rank, live tensor bytes)\n"
        f"  predicted time by term (ms): {terms}\n"
        f"  predicted memory by pipeline rank (MiB): {per_pp_rank}\n"
        + format_rank_table(v.per_rank)
    )


def format_rank_table(rows: tuple[RankMemory, ...], max_rows: int = MAX_RANK_ROWS) -> str:
    """Peak memory per global rank, predicted beside measured; ranks past ``max_rows`` summed up.

    Empty when there are no rows. The summary line gives the omitted ranks' count and their
    largest error by magnitude (signed).
    """
    if not rows:
        return ""
    lines = ["  peak memory per rank (MiB, live tensor bytes):",
             "     rank  pp rank   predicted    measured    error"]
    lines += [
        f"  {r.rank:7d}  {r.pp_rank:7d}  {r.predicted_bytes / MIB:10.2f}"
        f"  {r.measured_bytes / MIB:10.2f}  {_percent(r.error):>7s}"
        for r in rows[:max_rows]
    ]
    rest = rows[max_rows:]
    if rest:
        errors = [r.error for r in rest if r.error is not None]
        largest = max(errors, key=abs) if errors else None
        lines.append(f"  ... {len(rest)} more ranks, largest error {_percent(largest)}")
    return "\n".join(lines) + "\n"




def _split_text(config: dict[str, Any]) -> str:
    """The plan's split in one line (``ParallelConfig.describe``; every dimension it has)."""
    from autopar.config import ParallelConfig

    try:
        return ParallelConfig.from_dict(config).describe()
    except (TypeError, ValueError, KeyError):
        return " ".join(f"{k}={config.get(k)}" for k in ("dp", "cp", "tp", "pp", "ep"))
