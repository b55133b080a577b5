"""``estimate(profile, cluster, config, split=, recompute=)``: the Estimate of one split.

The caller may bring a stage split and per-layer recompute (a Plan's, ``autopar.costing``
unwraps one); without them a ParallelConfig gets the faster fitting one of its most balanced
contiguous splits, by stage and by pipeline rank (``default_split``), and its ``recompute`` on
every block.
"""

from __future__ import annotations

from autopar.config import ParallelConfig
from autopar.cost_model.assemble import assemble, check_split
from autopar.cost_model.estimate import Estimate
from autopar.cost_model.framework_names import DEFAULT_FRAMEWORK
from autopar.cost_model.framework_support import model_support, split_recompute_refusal
from autopar.cost_model.frameworks import Framework, framework_supports, get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.recompute_layers import (
    blocks_recompute,
    recompute_refusal,
    stage_ranks,
)
from autopar.cost_model.stage_splits import framework_splits, split_refusal
from autopar.cost_model.tables import CostTable
from autopar.cost_model.validate import check_config
from autopar.graph.types import ModelProfile

__all__ = ["checked_split", "checked_table", "default_split", "estimate"]


def default_split(table: CostTable) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
    """Of the most balanced contiguous splits the framework cuts (``framework_splits``: by stage
    and by pipeline rank), the fastest that fits (the one needing the least memory when none
    does: switching on offload or recompute to make a config fit then never moves it to a
    hungrier split), and the config's recompute on every block."""
    cfg = table.config
    recompute = blocks_recompute((cfg.recompute,) * len(table.layers), table.block_mask)
    if cfg.num_stages == 1:
        return ((0, len(table.layers) - 1),), recompute
    splits = framework_splits(table, cfg.recompute)
    if len(splits) == 1:
        return splits[0], recompute

    def rank(split: tuple[tuple[int, int], ...]) -> tuple[bool, float]:
        est = assemble(table, split, recompute)
        return not est.fits, est.step_time_s if est.fits else est.memory_per_gpu_bytes

    return min(splits, key=rank), recompute


def checked_table(
    profile: ModelProfile, cluster: Cluster, config: ParallelConfig, framework: str | Framework
) -> CostTable:
    """The CostTable of ``config`` after checking it against the model, the cluster and what
    ``framework`` runs (ValueError naming the broken constraint)."""
    fw = get_framework(framework)
    check_config(profile, cluster, config)
    reason = framework_supports(fw, config) or model_support(fw, config, profile)
    if reason:
        raise ValueError(reason)
    return build_cost_table(profile, cluster, config, fw)


def estimate(
    profile: ModelProfile,
    cluster: Cluster,
    config: ParallelConfig,
    framework: str | Framework | None = None,
    *,
    split: tuple[tuple[int, int], ...] | None = None,
    recompute: tuple[str, ...] | None = None,
) -> Estimate:
    """Predict step time, throughput and per-GPU memory of a split.

    Args:
        profile: the model profile.
        cluster: the cluster.
        config: the degrees, batch and schedule.
        framework: the training framework that runs it (a name in ``FRAMEWORKS`` or a
            Framework record); default "autopar".
        split: (first, last) profile layer of every stage; default the balanced split.
        recompute: recompute choice of every profile layer; default the config's on every
            block, none elsewhere (every framework recomputes blocks only).

    Returns:
        The Estimate (fields and meanings in DESIGN.md).

    Raises:
        ValueError: naming the constraint an impossible config breaks, or what the framework
            cannot run.

    Example:
        >>> cluster = Cluster.preset("a100-80g")
        >>> est = estimate(profile, cluster, ParallelConfig(tp=8, global_batch=8))
    """
    table = checked_table(profile, cluster, config,
                          DEFAULT_FRAMEWORK if framework is None else framework)
    # every framework recomputes blocks only: the table costs the other layers' modes as none
    return assemble(table, *checked_split(table, split, recompute))


def checked_split(
    table: CostTable,
    split: tuple[tuple[int, int], ...] | None = None,
    recompute: tuple[str, ...] | None = None,
) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
    """(split, per-layer recompute) of ``table``'s config, the defaults filled in
    (``default_split``; ``config.recompute`` on every block with a given split), after checking
    that the split is well formed and that the table's framework runs it (ValueError naming
    what it cannot)."""
    config = table.config
    if split is None:
        split, default_recompute = default_split(table)
        recompute = default_recompute if recompute is None else recompute
    elif recompute is None:
        recompute = blocks_recompute((config.recompute,) * len(table.layers), table.block_mask)
    split = tuple((int(a), int(b)) for a, b in split)
    fw = table.framework
    check_split(table, split, recompute)  # a malformed split first, in its own words
    reason = split_refusal(fw.spec, fw.stage_splits, split, table.block_mask) or (
        recompute_refusal(fw.spec, fw.recompute_layers, recompute, split, table.block_mask,
                          stage_ranks(config)))
    if reason:
        raise ValueError(f"{reason}; re-plan for it with `autopar plan ... --framework {fw.spec}`")
    reason = split_recompute_refusal(config, recompute)  # its fix is in its own words
    if reason:
        raise ValueError(reason)
    return split, tuple(recompute)
