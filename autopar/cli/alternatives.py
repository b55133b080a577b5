"""Reference splits to compare the chosen plan with (pure DP, pure FSDP, tp doubled; for a
mixture-of-experts model the chosen split with the other ep choice, and FSDP with experts
sharded over the largest ep; for a plan that recomputes, the same split without recompute under
each memory-saving setting of its framework, ``MEMORY_SETTINGS``).

The planner's own runners-up say how close the race was; these references say why the obvious
splits lose (memory, communication). Each is estimated with ``autopar.estimate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopar.config import ParallelConfig
from autopar.cost_model.framework_settings import MEMORY_SETTINGS
from autopar.cost_model.frameworks import get_framework
from autopar.errors import AutoparError
from autopar.report import Alternative, config_label
from autopar.schedules import DEFAULT_SCHEDULE

__all__ = ["alternatives_for"]


def _references(best: ParallelConfig, world: int,
                experts: tuple[int, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
    flat = {"tp": 1, "pp": 1, "schedule": DEFAULT_SCHEDULE, "virtual_stages": 1,
            "sequence_parallel": False, "cp": 1, "dp_replicate": 1, "offload": "none"}
    refs = [
        (f"pure DP (dp={world}, zero=0)", {**flat, "dp": world, "ep": 1, "zero": 0}),
        (f"pure FSDP (dp={world}, zero=3)", {**flat, "dp": world, "ep": 1, "zero": 3}),
    ]
    if best.dp % 2 == 0 and (best.dp // 2) % best.dp_replicate == 0:
        refs.append(("", {"tp": best.tp * 2, "dp": best.dp // 2, "ep": 1}))
    if experts:
        refs += _ep_references(best, world, experts, flat)
    return refs


def _largest_ep(dp: int, experts: tuple[int, ...]) -> int:
    return max(e for e in range(1, dp + 1) if dp % e == 0 and all(n % e == 0 for n in experts))


def _ep_references(best: ParallelConfig, world: int, experts: tuple[int, ...],
                   flat: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The chosen split with ep toggled, and FSDP with the largest ep (MoE models)."""
    refs = []
    ep = 1 if best.ep > 1 else _largest_ep(best.dp, experts)
    if ep != best.ep:
        refs.append(("", {"ep": ep}))
    big = _largest_ep(world, experts)
    if big > 1:
        refs.append((f"FSDP + ep (dp={world}, zero=3, ep={big}, micro-batch 1)",
                     {**flat, "dp": world, "zero": 3, "ep": big, "micro_batch": 1}))
    return refs


def _with_batch(best: ParallelConfig, fields: dict[str, Any]) -> ParallelConfig:
    """``best`` with ``fields`` changed; micro-batch lowered to 1 if the batch no longer divides."""
    merged = {**best.to_dict(), **fields}
    if merged["global_batch"] % (merged["dp"] * merged["micro_batch"]):
        merged["micro_batch"] = 1
    return ParallelConfig.from_dict(merged)


def _memory_levers(profile: Any, cluster: Any, best: Any) -> list[Alternative]:
    """The chosen split without recompute under each memory-saving setting its framework has
    and the plan does not use, when the plan recomputes any layer."""
    import autopar

    fw = get_framework(best.framework)
    if all(mode == "none" for mode in best.recompute_per_layer):
        return []
    # on the device, its optimizer sharded over the data ranks (zero 1) where the plan's was not
    zero = 1 if best.config.data_ranks > 1 and best.config.zero == 0 else best.config.zero
    config = _with_batch(best.config, {"recompute": "none", "zero": zero, "offload": "none"})
    out = []
    for setting, words in MEMORY_SETTINGS.get(fw.name, {}).items():
        if setting in fw.settings:
            continue
        spec = f"{fw.spec}+{setting}"
        label = f"{words} (--framework {spec}), no recompute" + "".join(
            f", {k}={getattr(config, k)}" for k in ("zero", "offload")
            if getattr(config, k) != getattr(best.config, k))
        try:
            estimate = autopar.estimate(profile, cluster, config, framework=spec)
        except (AutoparError, ValueError) as e:
            out.append(Alternative(label=label, config=config, reason=str(e)))
            continue
        out.append(Alternative(label=label, config=config, estimate=estimate))
    return out


def alternatives_for(
    profile: Any, cluster: Any, best: Any, runners_up: Sequence[Any] = ()
) -> list[Alternative]:
    """The planner's runners-up, then the reference splits, each with its estimate.

    Args:
        profile: the ModelProfile.
        cluster: the Cluster.
        best: the chosen Plan.
        runners_up: the other Plans of the top-k, best first.

    Returns:
        Alternatives in display order; references that cannot be built carry the reason.
    """
    import autopar

    refs: list[tuple[str, dict[str, Any], ParallelConfig | None, str]] = []
    experts = tuple(sorted({x.moe.experts for x in profile.layers if x.moe is not None}))
    for label, fields in _references(best.config, cluster.num_gpus, experts):
        try:
            refs.append((label, fields, _with_batch(best.config, fields), ""))
        except ValueError as e:
            refs.append((label, fields, None, str(e)))
    named = {config: label for label, _f, config, _r in refs if config is not None and label}
    out = [
        Alternative(label=named.get(p.config) or config_label(p.config, best.config),
                    config=p.config, estimate=p.estimate)
        for p in runners_up
    ]
    seen = {best.config, *(p.config for p in runners_up)}
    for label, fields, config, reason in refs:
        if config is None:
            out.append(Alternative(label=label or str(fields), reason=reason))
            continue
        if config in seen:
            continue
        seen.add(config)
        name = label or config_label(config, best.config)
        try:
            estimate = autopar.estimate(profile, cluster, config, framework=best.framework)
        except (AutoparError, ValueError) as e:
            out.append(Alternative(label=name, config=config, reason=str(e)))
            continue
        out.append(Alternative(label=name, config=config, estimate=estimate))
    return out + _memory_levers(profile, cluster, best)


