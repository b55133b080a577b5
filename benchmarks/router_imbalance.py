"""The dropless router's load imbalance of a model family, fitted through the cost model to
published pairs of runs that differ in the router alone (dropless against forced balance).

Run: ``python benchmarks/router_imbalance.py``. For each pair of
``benchmarks/data/moe_router_balance.json`` (each number with its source), the calls a user makes
(``models.build`` / ``models.from_hf_config``, ``profile``, ``Cluster.preset``,
``estimate(..., framework=...)``): the forced-balance run (the framework's
``moe-force-balance`` setting) and the dropless one at router imbalance f (the model's
``router_imbalance``: the busiest expert-parallel rank's routed rows over the average). f is
solved so that the predicted step-time ratio equals the measured one (the two runs' TFLOP/s
share one FLOP count, so their ratio is the step times'). Printed per pair: the measured ratio,
the ratio at the default ``DROPLESS_IMBALANCE``, the fitted f, and the forced-balance run's
predicted TFLOP/s beside the measured (the absolute level, which the pair does not fit), and
beside them the same run costed with the experts split over tp (the framework without the
pair's ``expert-tp-1``: Megatron-LM's default); then each family's fit (the median of its
pairs) beside the value its zoo presets carry.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
from pathlib import Path

from calibration import record_cluster

import autopar
from autopar.cost_model.moe import DROPLESS_IMBALANCE
from autopar.models.presets import PRESETS

DATA = Path(__file__).parent / "data"
PAIRS = DATA / "moe_router_balance.json"
# Presets whose released router belongs to a family with fitted pairs.
FAMILY_PRESETS = {"mixtral": ("mixtral-8x7b", "mixtral-8x22b")}
LOW, HIGH, TOLERANCE = 1.0, 4.0, 1e-4


def load_pairs(path: Path = PAIRS) -> list[dict]:
    """Every published dropless / forced-balance pair."""
    return json.loads(path.read_text())


@functools.cache
def _profile(model: str, seq_len: int):
    hf = DATA / f"{model}.json"
    if hf.exists():
        config = {k: v for k, v in json.loads(hf.read_text()).items() if not k.startswith("_")}
        built = autopar.models.from_hf_config(config)
    else:
        built = autopar.models.build(model, seq_len=seq_len)
    return autopar.profile(built, seq_len=seq_len)


def with_imbalance(profile, factor: float):
    """The profile with every MoE layer's ``router_imbalance`` set to ``factor``."""
    layers = tuple(
        dataclasses.replace(x, moe=dataclasses.replace(x.moe, router_imbalance=factor))
        if x.moe else x for x in profile.layers)
    return dataclasses.replace(profile, layers=layers)


def pair_inputs(pair: dict):
    """(profile, cluster, config) of a pair's runs."""
    p = pair["plan"]
    config = autopar.ParallelConfig(
        dp=p["dp"], tp=p["tp"], pp=p["pp"], cp=p.get("cp", 1), ep=p["ep"],
        micro_batch=p["microbatch"], global_batch=p["global_batch"],
        schedule=p["schedule"], virtual_stages=p["virtual_stages"], recompute=p["recompute"],
        sequence_parallel=p["sequence_parallel"], zero=p["zero_stage"], dtype=p["precision"])
    return _profile(pair["model"], pair["seq_len"]), record_cluster(pair), config


def step_s(pair: dict, factor: float | None) -> float:
    """Predicted step time of the pair's run: dropless at imbalance ``factor``, or forced
    balance (``factor`` None)."""
    profile, cluster, config = pair_inputs(pair)
    if factor is None:
        return autopar.estimate(profile, cluster, config,
                                framework=pair["framework"] + "+moe-force-balance").step_time_s
    return autopar.estimate(with_imbalance(profile, factor), cluster, config,
                            framework=pair["framework"]).step_time_s


def measured_ratio(pair: dict) -> float:
    """Dropless step time over forced balance's, from the published TFLOP/s."""
    m = pair["measured"]
    return m["forced_balance_tflops_per_gpu"] / m["dropless_tflops_per_gpu"]


def fit_imbalance(pair: dict) -> float:
    """The imbalance f at which the predicted dropless / forced step ratio equals the
    measured one (bisection; the step time grows with f)."""
    target = measured_ratio(pair) * step_s(pair, None)
    low, high = LOW, HIGH
    if step_s(pair, high) < target:
        return high
    while high - low > TOLERANCE:
        mid = (low + high) / 2
        low, high = (mid, high) if step_s(pair, mid) < target else (low, mid)
    return (low + high) / 2


def family_fits(pairs: list[dict]) -> dict[str, float]:
    """Each family's fitted imbalance: the median of its pairs' fits."""
    fits: dict[str, list[float]] = {}
    for pair in pairs:
        fits.setdefault(pair["family"], []).append(fit_imbalance(pair))
    return {family: statistics.median(values) for family, values in fits.items()}


def main() -> int:
    pairs = load_pairs()
    print(f"{'pair':40s} {'measured':>9s} {f'at {DROPLESS_IMBALANCE:g}x':>9s} "
          f"{'fitted f':>9s}   forced-balance TFLOP/s predicted / measured (experts split)")
    for pair in pairs:
        profile, cluster, config = pair_inputs(pair)
        forced, split = (autopar.estimate(profile, cluster, config, framework=spec
                                          + "+moe-force-balance")
                         for spec in (pair["framework"],
                                      pair["framework"].replace("+expert-tp-1", "")))
        default = step_s(pair, DROPLESS_IMBALANCE) / forced.step_time_s
        print(f"{pair['id']:40s} {measured_ratio(pair):9.3f} {default:9.3f} "
              f"{fit_imbalance(pair):9.3f}   {forced.tflops_per_gpu:6.0f} / "
              f"{pair['measured']['forced_balance_tflops_per_gpu']} "
              f"({split.tflops_per_gpu:.0f})")
    print()
    for family, value in family_fits(pairs).items():
        carried = [f"{name} {dict(PRESETS[name][0]).get('router_imbalance', 0):g}"
                   for name in FAMILY_PRESETS.get(family, ())]
        print(f"family {family}: fitted router_imbalance {value:.3f}; presets: "
              f"{', '.join(carried) or 'none'}")
    print(f"default for a model that states none: DROPLESS_IMBALANCE {DROPLESS_IMBALANCE:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
