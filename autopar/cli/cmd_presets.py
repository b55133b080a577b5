"""``autopar presets``: the zoo's model presets and the cluster presets."""

from __future__ import annotations

import argparse
import json

from autopar.cli import common

NAME = "presets"
HELP = "list the model zoo presets and the cluster (GPU) presets"
ORDER = 70


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``presets``'s arguments."""
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _gpus() -> dict[str, dict[str, float | str]]:
    from autopar.cost_model.hardware import Cluster

    out: dict[str, dict[str, float | str]] = {}
    for name in Cluster.list_presets():
        device = Cluster.preset(name, nodes=1, gpus_per_node=1).device
        out[name] = {
            "device": device.name,
            "memory_bytes": device.memory_bytes,
            "peak_bf16_flops": device.peak_bf16_flops,
        }
    return out


def run(args: argparse.Namespace) -> int:
    """Print both lists (a table, or JSON with --json)."""
    from rich.table import Table

    from autopar.models import list_presets
    from autopar.units import format_bytes

    models, gpus = list_presets(), _gpus()
    if args.json:
        print(json.dumps({"models": models, "clusters": gpus}, indent=2, sort_keys=True))
        return 0
    console = common.make_console(stderr=False)
    table = Table(title="Model presets (autopar plan NAME ...)", title_justify="left")
    table.add_column("name")
    table.add_column("shape and source")
    for name, text in models.items():
        table.add_row(name, text)
    console.print(table)
    table = Table(title="Cluster presets (--gpu NAME)", title_justify="left")
    for column in ("name", "device", "memory", "bf16 peak TFLOP/s"):
        table.add_column(column)
    for name, info in gpus.items():
        table.add_row(
            name,
            str(info["device"]),
            format_bytes(float(info["memory_bytes"])),
            f"{float(info['peak_bf16_flops']) / 1e12:.0f}",
        )
    console.print(table)
    return 0
