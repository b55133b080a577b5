"""Sweep GPU counts and GPU kinds for one model: best plan per point, days to train, cost.

For every (GPU kind, GPU count) the planner's best plan gives the job's tokens per second;
``days = tokens / tokens_per_s / 86400``, ``gpu_hours = num_gpus * days * 24`` and
``cost = gpu_hours * price_per_gpu_hour`` when a price is known. A point is on the Pareto front
when no other point is at least as fast and at least as cheap (cost, or GPU-hours without
prices) and strictly better in one of the two.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autopar.cost_model.framework_names import DEFAULT_FRAMEWORK

__all__ = ["SweepPoint", "mark_pareto", "parse_prices", "sweep"]

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepPoint:
    """One point of a sweep.

    Attributes:
        gpu: GPU preset name.
        num_gpus: GPUs in the job.
        split: the best plan's config in words ("" when none).
        tokens_per_s: job throughput.
        mfu: model FLOPs utilisation.
        days: days to train on the requested tokens.
        gpu_hours: GPU-hours to train.
        cost: gpu_hours x price (None without a price).
        pareto: on the time/cost Pareto front.
        error: why there is no plan ("" when there is).
    """

    gpu: str
    num_gpus: int
    split: str = ""
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    days: float = 0.0
    gpu_hours: float = 0.0
    cost: float | None = None
    pareto: bool = False
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; a point without a plan has null figures (not 0 days, which a
        script sorting on them would take for the fastest)."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        if self.error:
            out.update(tokens_per_s=None, mfu=None, days=None, gpu_hours=None)
        return out


# The dearest price per GPU-hour taken: beyond any rental (a typo), and the cost of a run at
# it stays a finite number in the JSON.
MAX_PRICE = 1e6


def parse_prices(text: str | None, gpus: Sequence[str]) -> dict[str, float]:
    """``"2.5"`` (every GPU) or ``"a100-80g=1.8,h100=3.2"`` -> {gpu: price per GPU-hour}.

    Raises:
        ValueError: a malformed price, or a GPU of the sweep without one in the per-GPU form.
    """
    if not text:
        return {}
    try:
        pairs = ([(g, float(text)) for g in gpus] if "=" not in text else
                 [(k.strip(), float(v)) for k, v in (p.split("=", 1) for p in text.split(","))])
    except ValueError as e:
        raise ValueError(
            f"--price-per-gpu-hour {text!r} is not a number or GPU=price list ({e})"
        ) from e
    prices = dict(pairs)
    if len(prices) < len(pairs):
        names = [g for g, _ in pairs]
        twice = sorted({g for g in names if names.count(g) > 1})
        raise ValueError(f"--price-per-gpu-hour {text!r} prices {', '.join(twice)} more than "
                         "once; give each GPU one price")
    bad = {g: p for g, p in prices.items() if not (math.isfinite(p) and 0 <= p <= MAX_PRICE)}
    if bad:
        raise ValueError(f"--price-per-gpu-hour {text!r}: a price must be a number from 0 to "
                         f"{MAX_PRICE:,.0f} (per GPU-hour), got "
                         f"{', '.join(f'{g}={p}' for g, p in bad.items())}")
    missing = [g for g in gpus if g not in prices]
    if missing:
        raise ValueError(f"--price-per-gpu-hour gives no price for {', '.join(missing)}")
    return prices


def mark_pareto(points: Sequence[SweepPoint]) -> tuple[SweepPoint, ...]:
    """The points with ``pareto`` set on the time/cost front (cost, else GPU-hours)."""

    def key(p: SweepPoint) -> tuple[float, float]:
        return p.days, p.cost if p.cost is not None else p.gpu_hours

    ok = [p for p in points if not p.error]
    out = []
    for p in points:
        dominated = bool(p.error) or any(
            key(q)[0] <= key(p)[0] and key(q)[1] <= key(p)[1] and key(q) != key(p) for q in ok
        )
        out.append(replace(p, pareto=not dominated))
    return tuple(out)


def sweep(
    profile: Any,
    *,
    clusters: Sequence[tuple[str, int, Any]],
    global_batch: int,
    tokens: float,
    prices: Mapping[str, float] | None = None,
    time_budget_s: float | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    model: str = "",
    framework: str = DEFAULT_FRAMEWORK,
) -> tuple[SweepPoint, ...]:
    """Plan every cluster and price the training run.

    Args:
        profile: the model's ModelProfile.
        clusters: (gpu name, GPU count, Cluster) per point.
        global_batch: sequences per step.
        tokens: tokens to train on.
        prices: price per GPU-hour by GPU name.
        time_budget_s: search time per point.
        progress: ``progress(done, total, message)`` called after each point.
        model: how to rebuild the model (recorded in the plans).
        framework: the training framework every plan is for.

    Returns:
        One SweepPoint per cluster, in order, with the Pareto front marked. Points that cannot
        be planned carry the reason in ``error``.
    """
    # NOTE: autopar.search.plan, not autopar.plan: once the autopar.plan module (Plan records)
    # is imported, the package attribute `plan` names that module, not the function.
    from autopar.errors import AutoparError
    from autopar.search import plan as search_plan

    prices = prices or {}
    points = []
    for i, (gpu, num_gpus, cluster) in enumerate(clusters):
        try:
            best = search_plan(profile, cluster, global_batch=global_batch,
                               time_budget_s=time_budget_s, model=model, framework=framework)
        except (AutoparError, ValueError) as e:
            points.append(SweepPoint(gpu=gpu, num_gpus=num_gpus, error=str(e).split("\n")[0]))
        else:
            points.append(_priced_point(gpu, num_gpus, best, tokens, prices.get(gpu)))
        if progress is not None:
            progress(i + 1, len(clusters), f"{gpu} x {num_gpus}")
    return mark_pareto(points)


def _priced_point(gpu: str, num_gpus: int, best: Any, tokens: float, price: float | None
                  ) -> SweepPoint:
    """The SweepPoint of a planned cluster: days to train ``tokens``, GPU-hours, cost."""
    est = best.estimate
    days = tokens / est.tokens_per_s / SECONDS_PER_DAY
    gpu_hours = num_gpus * days * 24
    return SweepPoint(gpu=gpu, num_gpus=num_gpus, split=best.config.describe(),
                      tokens_per_s=est.tokens_per_s, mfu=est.mfu, days=days,
                      gpu_hours=gpu_hours, cost=None if price is None else gpu_hours * price)
