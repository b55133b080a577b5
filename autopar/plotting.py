"""Figures of a plan (pipeline schedule over one step, per-rank memory) and of a sweep (PNG).

matplotlib's object API with the Agg canvas: no display, no pyplot global state.

The schedule panel replays one step of the plan's schedule from the per-rank time per
micro-batch of the Estimate: a chunk's forward takes a third of its time and its backward two
thirds (backward FLOPs = 2 x forward for matmuls); schedules that split the backward
(zero-bubble) run the input-gradient and weight-gradient halves as separate boxes. Each rank
runs, greedily, the highest-priority operation whose inputs are ready, under the schedule's
bound on forwards in flight (GPipe: none; 1F1B: pp - rank; interleaved: Megatron's warm-up
plus one, ``schedules.interleaved_warmup_forwards``). It is a picture of the schedule's shape, not a
trace of torch's action order; communication and the optimizer step are left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.config import ParallelConfig
from autopar.cost_model.compute import FORWARD_SHARE
from autopar.cost_model.estimate import Estimate
from autopar.schedules import get_schedule, interleaved_warmup_forwards
from autopar.units import GIB

__all__ = ["ScheduledOp", "plot_plan", "plot_sweep", "simulate_schedule"]

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
MEMORY_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")
_EPS_S = 1e-15


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledOp:
    """One forward (F), backward (B; input gradients when split) or weight-gradient (W) box."""

    kind: str
    microbatch: int
    stage: int
    rank: int
    start_s: float
    end_s: float


def _inflight_limit(config: ParallelConfig, rank: int, num_chunks: int) -> float:
    """Forwards a rank may have without their backward (the schedule's warm-up + 1)."""
    pp, v = config.pp, config.virtual_stages
    if config.schedule == "gpipe" or pp == 1:
        return float("inf")
    if config.schedule == "1f1b":
        return float(pp - rank)
    if get_schedule(config.schedule).v_shaped:
        return float(2 * (pp - rank))
    return float(min(interleaved_warmup_forwards(pp, v, rank, config.num_microbatches),
                     num_chunks))


def _deps(kind: str, m: int, s: int, num_stages: int) -> tuple[tuple[str, int, int], ...]:
    deps: list[tuple[str, int, int]] = [(kind, m - 1, s)] if m > 0 else []
    if kind == "F" and s > 0:
        deps.append(("F", m, s - 1))
    elif kind == "B":
        deps.append(("F", m, s) if s == num_stages - 1 else ("B", m, s + 1))
        if s < num_stages - 1:
            deps.append(("F", m, s))
    elif kind == "W":
        deps.append(("B", m, s))
    return tuple(deps)


def _priority(config: ParallelConfig, kind: str, m: int, s: int) -> tuple[int, ...]:
    group = m // config.pp
    if config.schedule == "gpipe":
        return ({"F": 0, "B": 1, "W": 2}[kind], m, s)
    chunk = s if kind == "F" else -s
    return ({"F": 0, "B": 1, "W": 2}[kind], group, chunk, m)


def simulate_schedule(
    config: ParallelConfig, placement: Mapping[int, int], chunk_time_s: Mapping[int, float]
) -> tuple[ScheduledOp, ...]:
    """Replay one step of a pipeline schedule.

    Args:
        config: the split (pp, schedule, micro-batches).
        placement: stage (model chunk) index -> pipeline rank.
        chunk_time_s: stage index -> forward + backward time of one micro-batch.

    Returns:
        Every operation with its rank and start/end time, in the order they were placed.
    """
    num_stages, num_mb = len(placement), config.num_microbatches
    kinds = ("F", "B", "W") if get_schedule(config.schedule).split_backward else ("F", "B")
    split = len(kinds) == 3
    ranks = sorted(set(placement.values()))
    stages_of = {r: sorted(s for s, rr in placement.items() if rr == r) for r in ranks}
    limit = {r: _inflight_limit(config, r, num_mb * len(stages_of[r])) for r in ranks}
    duration = {
        (k, s): chunk_time_s[s] * (FORWARD_SHARE if k == "F" or split else 1 - FORWARD_SHARE)
        for s in placement
        for k in kinds
    }
    next_mb = {(k, s): 0 for s in placement for k in kinds}
    end: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(ranks, 0.0)
    inflight = dict.fromkeys(ranks, 0)
    ops: list[ScheduledOp] = []
    while len(ops) < num_mb * num_stages * len(kinds):
        best = None
        for r in ranks:
            cands = []
            for s in stages_of[r]:
                for k in kinds:
                    m = next_mb[(k, s)]
                    deps = _deps(k, m, s, num_stages)
                    if m >= num_mb or any(d not in end for d in deps):
                        continue
                    if k == "F" and inflight[r] >= limit[r]:
                        continue
                    cands.append((max([free[r], *(end[d] for d in deps)]), k, m, s))
            if cands:
                t = min(c[0] for c in cands)
                ready = [c for c in cands if c[0] <= t + _EPS_S]
                pick = min(ready, key=lambda c: _priority(config, c[1], c[2], c[3]))
                if best is None or (t, r) < (best[0][0], best[1]):
                    best = (pick, r)
        if best is None:  # the bound admits no move (an unusual placement): lift it.
            limit = dict.fromkeys(ranks, float("inf"))
            continue
        (start, k, m, s), r = best
        stop = start + duration[(k, s)]
        end[(k, m, s)] = stop
        free[r] = stop
        next_mb[(k, s)] += 1
        inflight[r] += 1 if k == "F" else (-1 if k == "B" else 0)
        ops.append(ScheduledOp(kind=k, microbatch=m, stage=s, rank=r, start_s=start, end_s=stop))
    return tuple(ops)


def _time_unit(seconds: float) -> tuple[float, str]:
    return (1.0, "s") if seconds >= 1 else (1e3, "ms") if seconds >= 1e-3 else (1e6, "us")


def _schedule_panel(ax: Any, config: ParallelConfig, est: Estimate) -> None:
    placement = {s: st.rank for st in est.stages for s in st.stages}
    chunk_time = {
        s: st.time_per_microbatch_s / len(st.stages) for st in est.stages for s in st.stages
    }
    ops = simulate_schedule(config, placement, chunk_time)
    makespan = max(op.end_s for op in ops)
    scale, unit = _time_unit(makespan)
    label_boxes = config.num_microbatches * len(placement) <= 64
    for rank in sorted(set(placement.values())):
        ax.broken_barh([(0, makespan * scale)], (rank - 0.4, 0.8), color="#DDDDDD")
    # One broken_barh per (rank, kind): thousands of single boxes would take minutes to draw.
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for op in ops:
        spans.setdefault((op.rank, op.kind), []).append(
            (op.start_s * scale, (op.end_s - op.start_s) * scale)
        )
    for (rank, kind), boxes in sorted(spans.items()):
        ax.broken_barh(boxes, (rank - 0.4, 0.8), color=COLORS[kind], linewidth=0)
    for op in ops if label_boxes else ():
        width = (op.end_s - op.start_s) * scale
        if label_boxes:
            ax.text((op.start_s * scale) + width / 2, op.rank, str(op.microbatch), ha="center",
                    va="center", fontsize=6, color="white")
    busy = sum(op.end_s - op.start_s for op in ops)
    idle = 1 - busy / (makespan * len(set(placement.values())))
    ax.set_title(
        f"pipeline schedule: {config.schedule if config.pp > 1 else 'no pipeline'}, "
        f"{config.num_microbatches} micro-batches; grey = bubble ({idle * 100:.0f}% of ranks' time)"
    )
    ax.set_xlabel(f"time in one step ({unit})")
    ax.set_ylabel("pipeline rank")
    ax.invert_yaxis()
    ax.set_yticks(sorted(set(placement.values())))
    from matplotlib.patches import Patch

    handles = [Patch(color=COLORS[k], label=n)
               for k, n in (("F", "forward"), ("B", "backward"), ("W", "weight grad"))
               if any(op.kind == k for op in ops)]
    ax.legend(handles=handles, loc="upper right", fontsize=7)


def _memory_panel(ax: Any, est: Estimate) -> None:
    from autopar.report import MEMORY_KINDS

    ranks = [st.rank for st in est.stages]
    bottom = [0.0] * len(ranks)
    for (field, name), color in zip(MEMORY_KINDS, MEMORY_COLORS):
        values = [getattr(st.memory, field) / GIB for st in est.stages]
        ax.bar(ranks, values, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(est.memory_capacity_bytes / GIB, color="black", linestyle="--", label="capacity")
    ax.set_xticks(ranks)
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("GiB per GPU")
    ax.set_title("peak memory per GPU by kind")
    ax.legend(fontsize=7)


def plot_plan(config: ParallelConfig, est: Estimate, title: str = "") -> bytes:
    """PNG bytes of the two-panel figure: pipeline schedule over one step, memory per rank.

    Args:
        config: the split.
        est: its Estimate (needs per-rank ``stages``).
        title: a figure title.
    """
    from matplotlib.figure import Figure

    if not est.stages:
        raise ValueError("the estimate has no per-stage figures to plot")
    fig = Figure(figsize=(12, 4 + 0.25 * config.pp))
    grid = fig.add_gridspec(1, 2, width_ratios=(3, 1))
    _schedule_panel(fig.add_subplot(grid[0]), config, est)
    _memory_panel(fig.add_subplot(grid[1]), est)
    fig.suptitle(title or config.describe())
    fig.tight_layout()
    return _png(fig)


def _png(fig: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def plot_sweep(points: Sequence[Any], title: str = "") -> bytes:
    """PNG bytes: days to train against cost (or GPU-hours) per point, Pareto front joined.

    Args:
        points: ``autopar.sweep.SweepPoint`` records.
        title: a figure title.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    ok = [p for p in points if p.error == ""]
    priced = all(p.cost is not None for p in ok)
    y_of = (lambda p: p.cost) if priced else (lambda p: p.gpu_hours)
    for gpu in sorted({p.gpu for p in ok}):
        mine = [p for p in ok if p.gpu == gpu]
        ax.scatter([p.days for p in mine], [y_of(p) for p in mine], label=gpu)
        for p in mine:
            ax.annotate(str(p.num_gpus), (p.days, y_of(p)), fontsize=7)
    front = sorted((p for p in ok if p.pareto), key=lambda p: p.days)
    ax.plot([p.days for p in front], [y_of(p) for p in front], "k--", label="Pareto front")
    ax.set_xlabel("days to train")
    ax.set_ylabel("cost" if priced else "GPU-hours")
    ax.set_title(title or "sweep")
    ax.legend()
    fig.tight_layout()
    return _png(fig)
