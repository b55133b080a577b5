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
    # measured / predicted step time of autopar's own runs: 16 CPU configurations
    # (benchmarks/results/accuracy_cpu_202612.md as of commit a9aeaf4, measured on an idle
    # machine; the later run's calibration caught a faster phase of the shared cores, all its
    # errors one-sided, docs/verify.md) and 4 H200 plans (gpu_verify.py), p10 - p90.
    "autopar": {**_NEUTRAL, "step_time_band": (0.885, 1.35)},
    "torchtitan": {**_NEUTRAL, "kernel_efficiency": 0.9728, "step_overhead_s": 0.136,
                   "dp_comm_efficiency": 0.9651, "step_time_band": (0.86, 1.13)},
    "megatron-lm": {**_NEUTRAL, "kernel_efficiency": 0.9875, "step_overhead_s": 0.0,
                    "step_time_band": (0.88, 1.12)},
    "deepspeed": {**_NEUTRAL, "kernel_efficiency": 0.7707, "step_overhead_s": 0.5,
                  "step_time_band": (0.86, 1.25)},
}
# The fields each framework's calibration fits (the rest are sourced or measured).
FITTED_FIELDS: dict[str, tuple[str, ...]] = {
    "autopar": (),
    "torchtitan": ("kernel_efficiency", "step_overhead_s", "dp_comm_efficiency"),
    "megatron-lm": ("kernel_efficiency", "step_overhead_s"),
    "deepspeed": ("kernel_efficiency", "step_overhead_s"),
}
