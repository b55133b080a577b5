"""``estimate(profile, cluster, config_or_plan)``: the Estimate of one split.

A Plan brings its own stage split and per-layer recompute; a bare ParallelConfig gets the most
balanced contiguous split of its layers (min-max stage time, ``partition.balanced_partition``)
and its ``recompute`` for every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.config import ParallelConfig
from autopar.cost_model.assemble import assemble
from autopar.cost_model.estimate import Estimate
from autopar.cost_model.frameworks import Framework, framework_supports, get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.partition import balanced_partition
from autopar.cost_model.tables import CostTable
from autopar.cost_model.validate import check_config
from autopar.graph.types import ModelProfile

if TYPE_CHECKING:
    from autopar.plan import Plan

__all__ = ["checked_table", "default_split", "estimate"]


def default_split(table: CostTable) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
    """The balanced contiguous split and the config's recompute for every layer."""
    cfg = table.config
    recompute = (cfg.recompute,) * len(table.layers)
    if cfg.num_stages == 1:
        return ((0, len(table.layers) - 1),), recompute
    costs = [layer.time_per_microbatch_s(cfg.recompute) for layer in table.layers]
    return balanced_partition(costs, cfg.num_stages), recompute


def checked_table(
    profile: ModelProfile, cluster: Cluster, config: ParallelConfig, framework: str | Framework
) -> CostTable:
    """The CostTable of ``config`` after checking it against the model, the cluster and what
    ``framework`` runs (ValueError naming the broken constraint)."""
    fw = get_framework(framework)
    check_config(profile, cluster, config)
    reason = framework_supports(fw, config)
    if reason:
        raise ValueError(reason)
    return build_cost_table(profile, cluster, config, fw)


def estimate(
    profile: ModelProfile,
    cluster: Cluster,
    config_or_plan: ParallelConfig | Plan,
    framework: str | Framework | None = None,
) -> Estimate:
    """Predict step time, throughput and per-GPU memory of a split.

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
            cannot run; for a Plan, ``cluster`` not being the one it was made for (its cluster
            fingerprint; ``plan.for_cluster(cluster)`` re-targets it on purpose).

    Example:
        >>> cluster = Cluster.preset("a100-80g")
        >>> est = estimate(profile, cluster, ParallelConfig(tp=8, global_batch=8))
    """
    if isinstance(config_or_plan, ParallelConfig):
        cfg, plan = config_or_plan, None
    else:
        cfg, plan = config_or_plan.config, config_or_plan
        plan.check_cluster(cluster)
    if framework is None:
        framework = plan.framework if plan is not None else "autopar"
    table = checked_table(profile, cluster, cfg, framework)
    if plan is None:
        stage_layers, recompute = default_split(table)
    else:
        stage_layers = tuple(tuple(s.layers) for s in plan.stages)
        recompute = plan.recompute_per_layer
    return assemble(table, stage_layers, recompute)
