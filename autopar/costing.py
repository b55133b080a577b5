"""The cost model applied to a Plan: ``estimate``, ``explain_plan``, ``expected_collectives``.

The cost model (``autopar/cost_model/``) knows configs, stage splits and per-layer recompute, not
Plans: a Plan is the search's output, a layer above it. These functions unwrap a Plan into
(config, split, recompute, framework) and hand it on; given a bare ParallelConfig they pass it
as it is (the balanced split, the config's recompute). ``autopar.estimate`` is ``estimate`` here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autopar.config import ParallelConfig
from autopar.errors import AutoparError
from autopar.plan import Plan

if TYPE_CHECKING:
    from autopar.cost_model.estimate import Estimate
    from autopar.cost_model.frameworks import Framework
    from autopar.cost_model.hardware import Cluster
    from autopar.graph.types import ModelProfile

__all__ = ["estimate", "expected_collectives", "explain_plan", "plan_split"]


def plan_split(plan: Plan) -> dict[str, Any]:
    """A Plan's stage layer ranges and per-layer recompute, as the cost model's keywords."""
    return {"split": tuple(tuple(s.layers) for s in plan.stages),
            "recompute": plan.recompute_per_layer}


def estimate(
    profile: ModelProfile,
    cluster: Cluster,
    config_or_plan: ParallelConfig | Plan,
    framework: str | Framework | None = None,
) -> Estimate:
    """Predict step time, throughput and per-GPU memory of a config or a Plan.

    Args:
        profile: the model profile.
        cluster: the cluster.
        config_or_plan: a ParallelConfig (balanced split) or a Plan (its own split).
        framework: the training framework that runs it (a name in ``FRAMEWORKS`` or a
            Framework record); default: the plan's own, or "autopar" for a config.

    Returns:
        The Estimate (fields and meanings in DESIGN.md).

    Raises:
        ValueError: naming the constraint an impossible config breaks, or what the framework
            cannot run; for a Plan (``PlanMismatchError``), ``profile`` not being of the model it
            was made for (its profile fingerprint), or ``cluster`` not being the one it was made
            for (its cluster fingerprint; ``plan.for_cluster(cluster)`` re-targets it on
            purpose).
    """
    from autopar.cost_model.estimator import estimate as estimate_split
    from autopar.cost_model.validate import check_inputs

    check_inputs("estimate", profile, cluster)
    if isinstance(config_or_plan, ParallelConfig):
        return estimate_split(profile, cluster, config_or_plan, framework)
    if not isinstance(config_or_plan, Plan):
        raise TypeError(f"estimate() takes a ParallelConfig or a Plan, got "
                        f"{type(config_or_plan).__name__}")
    plan = config_or_plan
    plan.check_profile(profile)
    plan.check_cluster(cluster)
    return estimate_split(profile, cluster, plan.config,
                          plan.framework if framework is None else framework, **plan_split(plan))


def explain_plan(profile: ModelProfile, cluster: Cluster, plan: Plan) -> str:
    """The plan's memory and time formulas, then the same with its numbers substituted."""
    from autopar.cost_model.symbolic import explain
    from autopar.cost_model.validate import check_config, check_inputs

    check_inputs("explain_plan", profile, cluster)
    plan.check_profile(profile)
    try:  # what estimate refuses is not explained either (an edited plan's split)
        check_config(profile, cluster, plan.config)
    except ValueError as err:
        raise AutoparError(f"the plan's split cannot run on its model and cluster: {err}; "
                           "re-plan with `autopar plan`") from None
    split = plan_split(plan)
    return explain(profile, cluster, plan.config, split["split"], split["recompute"],
                   plan.framework)


def expected_collectives(
    profile: ModelProfile, plan_or_config: Plan | ParallelConfig, pp_rank: int = 0
) -> dict[str, int]:
    """Collectives per step on one rank of ``pp_rank`` (``cost_model.collectives``)."""
    from autopar.cost_model.collectives import expected_collectives as count
    from autopar.cost_model.validate import check_inputs

    check_inputs("expected_collectives", profile)

    if isinstance(plan_or_config, ParallelConfig):
        return count(profile, plan_or_config, pp_rank)
    plan_or_config.check_profile(profile)
    return count(profile, plan_or_config.config, pp_rank, **plan_split(plan_or_config))
