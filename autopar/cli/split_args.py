"""The split flags of ``estimate`` and ``run`` (dp, cp, tp, pp, ep, HSDP, offload, micro-batch,
global batch, schedule, chunks, recompute, sequence parallelism, ZeRO, dtype), declared once.

``estimate`` gets the defaults of a one-rank split; ``run`` gets ``None`` for every flag, so that it
can tell the flags given (refused beside a plan, which brings its own split) from the ones left
out, and only the dtypes autopar's runtime trains in. Both parse each value the same way: degrees
and batch sizes are integers of at least 1 (``argtypes.int_in``), names are checked against the
one list of each (``autopar.config``).
"""

from __future__ import annotations

import argparse

from autopar.cli.argtypes import int_in
from autopar.config import DTYPES, MAX_GLOBAL_BATCH, OFFLOADS, RECOMPUTE, SCHEDULES, ZERO_STAGES
from autopar.cost_model.hardware import MAX_GPUS
from autopar.schedules import DEFAULT_SCHEDULE

__all__ = ["add_split_arguments"]


def add_split_arguments(split: argparse._ArgumentGroup, *, for_run: bool) -> None:
    """Declare the split flags on ``split`` (module docstring: ``for_run`` picks run's)."""
    def default(value: object) -> object:
        return None if for_run else value

    for name in ("dp", "cp", "tp", "pp"):
        split.add_argument(f"--{name}", type=int_in(1, MAX_GPUS), default=default(1),
                           help=f"{name} degree (default 1)")
    split.add_argument("--ep", type=int_in(1, MAX_GPUS), default=default(1),
                       help="expert-parallel degree of a mixture-of-experts model (divides "
                       "dp * cp; default 1)")
    split.add_argument("--dp-replicate", type=int_in(1, MAX_GPUS), default=default(1),
                       help="HSDP replicas of a dp / dp_replicate shard group (needs --zero >= 1; "
                       "default 1)")
    split.add_argument("--offload", default=default("none"), choices=OFFLOADS,
                       help="optimizer state (and parameters) in host memory (needs --zero >= 1; "
                       "default none)")
    split.add_argument("--micro-batch", type=int_in(1, MAX_GLOBAL_BATCH), default=default(1),
                       help="sequences per micro-batch (default 1)")
    split.add_argument("--global-batch", type=int_in(1, MAX_GLOBAL_BATCH),
                       required=not for_run, help="sequences per step")
    split.add_argument("--schedule", default=default(DEFAULT_SCHEDULE), choices=SCHEDULES,
                       help=f"pipeline schedule (default {DEFAULT_SCHEDULE})")
    split.add_argument("--virtual-stages", type=int_in(1, 1024), default=None,
                       help="model chunks per pipeline rank (default 2 for interleaved "
                       "schedules)")
    split.add_argument("--recompute", default=default("none"), choices=RECOMPUTE)
    split.add_argument("--sequence-parallel", action="store_true", default=default(False))
    split.add_argument("--zero", type=int, default=default(0), choices=ZERO_STAGES,
                       help="ZeRO stage (default 0)")
    if for_run:
        from autopar.cost_model.framework_names import RUNTIME
        from autopar.cost_model.frameworks import get_framework

        split.add_argument("--dtype", default=None,
                           choices=[d for d in DTYPES if d in get_framework(RUNTIME).dtypes],
                           help="training precision (default fp32 on CPU, bf16 on GPU)")
    else:
        split.add_argument("--dtype", default="bf16", choices=DTYPES)
