"""``autopar calibrate``: measure this machine into a cluster YAML.

The measurement is the runtime's (``autopar.runtime.calibrate.calibrate``), the fit to a Cluster
the cost model's (``autopar.cost_model.calibration.calibration_to_cluster``); this module checks
the command's inputs, writes the YAML and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import sys

from autopar.cli import common
from autopar.cli.argtypes import int_in
from autopar.cost_model.calibration import Calibration
from autopar.errors import AutoparError

__all__ = ["HELP", "NAME", "ORDER", "add_arguments", "add_calibrate_arguments",
           "calibrate_command", "format_calibration", "run"]

NAME = "calibrate"
HELP = "measure this machine's compute and collectives into a cluster YAML"
ORDER = 90
# The most processes calibrate starts: the GPUs of one large node, or CPU workers well past
# any machine's cores (each is a whole Python process).
MAX_NPROC = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``calibrate``'s arguments."""
    add_calibrate_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run ``autopar calibrate`` (see ``calibrate_command``)."""
    return calibrate_command(args)


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the arguments of ``autopar calibrate`` on ``parser``."""
    parser.add_argument("--nproc", type=int_in(1, MAX_NPROC), default=None,
                        help="processes (devices) to measure with (default: the visible GPUs, "
                        "else 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="device type (default: cuda when a GPU is visible)")
    parser.add_argument("--out", default="cluster.yaml",
                        help="cluster YAML to write (default cluster.yaml)")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    parser.add_argument("--quick", action="store_true", help="a shorter sweep (less accurate)")
    parser.add_argument("--json", action="store_true",
                        help="print the raw measurements and fits as JSON on stdout")


def calibrate_command(args: argparse.Namespace) -> int:
    """Run ``autopar calibrate``: measure, write the cluster YAML, print a summary.

    Raises:
        AutoparError: --out exists without --force, or an impossible --nproc.
    """
    import torch

    from autopar.cost_model.calibration import calibration_to_cluster
    from autopar.runtime.calibrate import calibrate

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise AutoparError("--device cuda, but torch sees no GPU here; calibrate the CPU "
                           "(--device cpu) or run on a machine with GPUs")
    nproc = args.nproc or (torch.cuda.device_count() if device_type == "cuda" else 2)
    # Before minutes of measuring: a directory, a missing folder, a file kept without --force.
    common.check_writable(args.out, force=args.force)
    if nproc < 1:
        raise AutoparError(f"--nproc must be at least 1, got {nproc}")
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise AutoparError(f"--nproc {nproc} exceeds the {torch.cuda.device_count()} visible GPUs")
    cal = calibrate(nproc, device_type, quick=args.quick)
    cluster = calibration_to_cluster(cal)
    # Atomically, as every other output (common.write_outputs).
    common.write_output(args.out, cluster.to_yaml_text(), force=args.force)
    summary = format_calibration(cal) + f"wrote {args.out}\n"
    if args.json:
        print(summary, end="", file=sys.stderr)
        print(json.dumps(cal.to_dict(), sort_keys=True))
    else:
        print(summary, end="")
    return 0


def format_calibration(cal: Calibration) -> str:
    """A short human-readable summary of a calibration."""
    lines = [
        f"calibrated {cal.nproc} {cal.device_type} process(es) in {cal.wall_s:.1f} s",
        f"  matmul ({cal.dtype}): {cal.matmul_peak_flops / 1e9:.1f} GFLOP/s per process, "
        f"{cal.matmul_fixed_s * 1e6:.1f} us per call (fit error {cal.matmul_median_rel_error:.0%})",
        f"  copy bandwidth: {cal.memory_bytes_per_s / 1e9:.2f} GB/s per process",
        f"  framework: {cal.op_overhead_s * 1e6:.1f} us per op, block fwd+bwd "
        f"{cal.layer_overhead_s * 1e3:.2f} ms, +{cal.dtensor_layer_overhead_s * 1e3:.2f} ms "
        f"with DTensor ({cal.dtensor_module_overhead_s * 1e3:.2f} ms per module), "
        f"+{cal.fsdp_layer_overhead_s * 1e3:.2f} ms with FSDP2; rest of the model "
        f"{cal.nonblock_overhead_s * 1e3:.2f} ms",
        f"  AdamW step: {cal.optimizer_layer_overhead_s * 1e3:.2f} ms per block, "
        f"+{cal.dtensor_optimizer_layer_overhead_s * 1e3:.2f} ms with DTensor parameters; "
        f"checkpointed block +{cal.recompute_layer_overhead_s * 1e3:.2f} ms; "
        f"{cal.cpu_cores or '?'} cores",
    ]
    for c in cal.collectives:
        lines.append(
            f"  {c.op:<24s} n={c.group_size}: alpha {c.latency_s * 1e3:.3f} ms, "
            f"bus bandwidth {c.bandwidth_bytes_per_s / 1e9:.2f} GB/s "
            f"(fit error median {c.median_rel_error:.0%}, max {c.max_rel_error:.0%})"
        )
    return "\n".join(lines) + "\n"
