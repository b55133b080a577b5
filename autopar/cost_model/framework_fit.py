"""The framework records' fitted values and their shared constants: each framework's fitted
fields and step-time band (``benchmarks/calibration.py --fit`` and ``--loso``; the fit and its
table are in docs/frameworks.md), the neutral values a fit starts from, and which fields each
framework fits.
"""

from __future__ import annotations

__all__ = ["FIT", "FITTED_FIELDS", "NEUTRAL_FIT", "OVERLAP_SLOWDOWN"]

# ---- values fitted by `benchmarks/calibration.py --fit` (each framework on its own records) ----
# and their leave-one-source-out error bands; see docs/frameworks.md for the fit and its table.
# Compute slowed by 18.9% on average while NCCL collectives overlap it (Lee et al.,
# "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning",
# arXiv:2507.03114, 2025: GPT and Llama on 4 A100 / H100 / MI250 / MI210; at most 40%).
OVERLAP_SLOWDOWN = 0.19
NEUTRAL_FIT = _NEUTRAL = {"kernel_efficiency": 1.0, "step_overhead_s": 0.0,
                          "overlap_slowdown": OVERLAP_SLOWDOWN,
                          "dp_comm_efficiency": 1.0, "zero3_comm_efficiency": 1.0}
FIT: dict[str, dict[str, object]] = {
    # measured / predicted step time of autopar's own runs, p10 - p90, printed by
    # benchmarks/autopar_band.py: the 77 CPU accuracy runs (five sessions of 15-16
    # configurations on 4 gloo processes each, predicted on that session's calibration: two
    # sessions' calibrations caught faster phases of the shared cores and ran 0.98 - 1.79, the
    # idle ones of 2026-12-04 and 2026-12-05 0.79 - 1.43, the fifth (2026-12-05, another
    # machine) 1.06 - 1.51; the three older sessions' interleaved
    # zero-bubble run at zero 3 is left out, it reduced wrong gradients) and 6 whole steps on
    # one H200 (autopar verify, 0.97 - 1.09); tests/unit/test_autopar_band.py keeps this equal.
    "autopar": {**_NEUTRAL, "step_time_band": (0.95, 1.47)},
    "torchtitan": {**_NEUTRAL, "kernel_efficiency": 0.9728, "step_overhead_s": 0.136,
                   "dp_comm_efficiency": 0.9651, "step_time_band": (0.86, 1.13)},
    "megatron-lm": {**_NEUTRAL, "kernel_efficiency": 0.9909, "step_overhead_s": 0.0,
                    "step_time_band": (0.88, 1.12)},
    "deepspeed": {**_NEUTRAL, "kernel_efficiency": 0.773, "step_overhead_s": 0.5,
                  "step_time_band": (0.86, 1.25)},
}
# The fields each framework's calibration fits (the rest are sourced or measured).
FITTED_FIELDS: dict[str, tuple[str, ...]] = {
    "autopar": (),
    "torchtitan": ("kernel_efficiency", "step_overhead_s", "dp_comm_efficiency"),
    "megatron-lm": ("kernel_efficiency", "step_overhead_s"),
    "deepspeed": ("kernel_efficiency", "step_overhead_s"),
}
