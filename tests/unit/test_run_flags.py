"""``autopar run``'s split flags for the dimensions beyond dp x tp x pp reach the ParallelConfig."""

from __future__ import annotations

import argparse

import pytest

from autopar.cli.cmd_run import _config_from_args, _resolve_job, add_run_arguments
from autopar.errors import AutoparError

MODEL = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq_len=16"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return parser.parse_args([*argv, "--steps", "1"])


def test_cp_hsdp_offload_flags_make_the_config() -> None:
    args = _args(MODEL, "--dp", "4", "--cp", "2", "--dp-replicate", "2", "--zero", "3",
                 "--offload", "params", "--global-batch", "8")
    config = _config_from_args(args)
    assert (config.dp, config.cp, config.dp_replicate, config.offload) == (4, 2, 2, "params")
    assert (config.world_size, config.dp_shard) == (8, 2)
    defaults = _config_from_args(_args(MODEL, "--global-batch", "8"))
    assert (defaults.cp, defaults.dp_replicate, defaults.offload) == (1, 1, "none")


@pytest.mark.parametrize("flag", [("--cp", "2"), ("--dp-replicate", "2"), ("--offload", "params")])
def test_a_plan_brings_its_own_dimensions(tmp_path, flag: tuple[str, str]) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text('{"schema_version": 1}')
    with pytest.raises(AutoparError, match=f"drop {flag[0]}"):
        _resolve_job(_args(str(plan), *flag))
