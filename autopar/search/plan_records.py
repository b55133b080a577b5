"""The Plan record of a split (``plan_record``) and the robust ordering of plans.

A Plan carries its split's stages, tensor-parallel layout, estimate (``assemble`` of the split
under its own config) and the fingerprints of the profile and cluster it was made for.
"""

from __future__ import annotations

from autopar.cost_model.assemble import assemble
from autopar.cost_model.tables import CostTable
from autopar.plan import Plan, SearchInfo, StagePlan
from autopar.search.layout import tp_layout

__all__ = ["first_moe", "plan_record", "robust_order", "stage_plans"]


def stage_plans(profile, split, recompute) -> tuple[StagePlan, ...]:
    names = [layer.name for layer in profile.layers]
    return tuple(
        StagePlan(
            index=j,
            layers=(a, b),
            layer_names=tuple(names[a : b + 1]),
            recompute=tuple(recompute[a : b + 1]),
        )
        for j, (a, b) in enumerate(split)
    )


def plan_record(profile, cluster, table: CostTable, split, recompute, *, model: str,
                 search: SearchInfo | None = None) -> Plan:
    """The Plan of a split of ``table``'s config for ``table``'s framework (its canonical spec);
    its estimate is ``assemble`` of the split."""
    config = table.config
    return Plan(
        config=config,
        stages=stage_plans(profile, split, recompute),
        tp_layout=tp_layout(profile, tp=config.tp, sequence_parallel=config.sequence_parallel),
        estimate=assemble(table, split, recompute),
        profile_fingerprint=profile.fingerprint(),
        cluster_fingerprint=cluster.fingerprint(),
        model=model,
        seq_len=profile.seq_len,
        loss=profile.loss,
        cluster=cluster.to_dict(),
        search=search or SearchInfo(),
        framework=table.framework.spec,
        moe=first_moe(profile),
    )


def first_moe(profile):
    """The profile's first mixture-of-experts record (None for a dense model)."""
    return next((layer.moe for layer in profile.layers if layer.moe is not None), None)


def robust_order(plans: list[Plan]) -> list[Plan]:
    """Plans by pessimistic step time (the high end of ``step_time_interval_s``), those whose
    memory fits even at the high end of the framework's memory band first."""
    from autopar.cost_model.frameworks import get_framework

    def key(p: Plan) -> tuple[bool, float, float]:
        band = get_framework(p.framework).memory_band
        est = p.estimate
        safe = est.memory_per_gpu_bytes * (1.0 + band) <= est.memory_capacity_bytes
        return (not safe, est.step_time_interval_s[1], est.step_time_s)

    return sorted(plans, key=key)
