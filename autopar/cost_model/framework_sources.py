"""Where a framework record's fields come from when its record does not say: the fitted fields,
the bands, the shared overlap sources, each setting's default, and the documentation.
"""

from __future__ import annotations

from autopar.cost_model.framework_fit import FITTED_FIELDS
from autopar.cost_model.framework_settings import (
    OVERLAP_SOURCES,
    SETTING_EFFECTS,
    SETTING_OFF,
    SETTINGS,
)

__all__ = ["MEMORY_BAND", "MEMORY_BAND_SOURCE", "default_sources"]

# measured: the largest error of predicted peak memory over autopar's own runs in the latest
# reference measurement (16 configurations on CPU; tests/unit/test_frameworks.py reads it
# there). No published memory figure of another framework is fitted yet: theirs is this band.
MEMORY_BAND = 0.078
MEMORY_BAND_SOURCE = ("benchmarks/results/accuracy_cpu_20261205.md (benchmarks/accuracy.py): "
                      "largest memory error 7.8% over 16 configurations (CPU)")

_WHOLE_INPUT = ("sourced: full recompute keeps the block input whole on the device (the "
                "framework's checkpoint keeps its inputs as given)")
# Fields a setting switches, with their source where the framework has no such setting.
_SETTING_FIELDS = {
    "fp8_param_gather": "sourced: parameters gathered at their 16-bit dtype",
    "checkpoint_partitioned": _WHOLE_INPUT,
    "checkpoint_offloaded": _WHOLE_INPUT,
    "adam_moment_bytes": "sourced: fp32 exp_avg and exp_avg_sq (Adam's state at the fp32 "
                         "master dtype)",
}


def default_sources(name: str) -> dict[str, str]:
    """field -> its source for framework ``name``, for the fields its record leaves unsaid."""
    out: dict[str, str] = {}
    for key in (*FITTED_FIELDS[name], "step_time_band"):
        out.setdefault(key, "fitted: benchmarks/calibration.py --fit on this framework's "
                                "published runs (benchmarks/data/published_runs.json)")
    out.setdefault("memory_band", f"measured: autopar's own band, {MEMORY_BAND_SOURCE}; no "
                                  "published memory figure of this framework fitted yet")
    out.setdefault("overlap_slowdown", "sourced: arXiv:2507.03114 (18.9% average compute "
                                          "slowdown under overlapped NCCL collectives)")
    for key, text in OVERLAP_SOURCES[name].items():
        out.setdefault(key, text)
    out.setdefault("settings", "sourced: the user's switches (SETTINGS), none by default")
    # a field one of the framework's settings turns on: off unless that setting is on
    for key, otherwise in _SETTING_FIELDS.items():
        named = [x for x in SETTINGS[name] if key in SETTING_EFFECTS[x]]
        out.setdefault(key, SETTING_OFF.format(named[0]) if named else otherwise)
    out.setdefault("interleaved_groups_of_pp", "sourced: torch's ScheduleInterleaved1F1B / "
                   "InterleavedZeroBubble (rounds max(1, m // pp), m % rounds == 0), or no "
                   "interleaved schedule (the record's schedules)")
    out.setdefault("loss_grad_in_place", "sourced: torch's cross_entropy on fp32 logits "
                                             "(log_softmax and nll_loss backward allocate)")
    out.setdefault("fp8_scaling", "sourced: torchao Float8Linear's tensorwise dynamic "
                                      "scaling (torchtitan's float8 converter and autopar's "
                                      "runtime use it)")
    out.setdefault("selective_policy", "sourced: the framework's selective recomputation "
                                           "re-runs the attention core (Korthikanti et al. 2022)")
    for key in ("kernel_efficiency", "step_overhead_s",
                "dp_comm_efficiency", "zero3_comm_efficiency"):
        out.setdefault(key, "sourced: no such mechanism charged for this framework "
                                "(neutral value)")
    for key in ("elementwise_traffic_scale", "first_gather_exposed", "zero3_live_params",
                "sequence_parallel", "zero_with_pipeline", "exports", "runtime",
                "zero3_gather", "schedules", "zero_stages",
                "reduce_bucket_params", "dp_overlap_efficiency", "param_traffic_factor",
                "ep_needs_sharded_dp", "ep_with_tp"):
        out.setdefault(key, "sourced: the framework's documentation (docs/frameworks.md)")
    return out
