"""Acceptance checks of ``autopar run`` that need no process (issue 5): the split its flags
describe, and the torchrun command line it launches on one node and on several."""

from __future__ import annotations

import argparse

import pytest
import torch

from autopar.cli.cmd_run import _config_from_args, add_run_arguments
from autopar.errors import AutoparError, PlanMismatchError
from autopar.runtime.launch import launch_spec_for, torchrun_command

MODEL = "gpt:layers=4,hidden=64,heads=4,vocab=256,seq_len=32"


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return _config_from_args(parser.parse_args([MODEL, "--steps", "1", *argv]))


def test_split_flags_and_their_defaults():
    cfg = _config("--global-batch", "8")
    assert (cfg.dp, cfg.tp, cfg.pp, cfg.micro_batch, cfg.zero) == (1, 1, 1, 1, 0)
    assert cfg.schedule == "1f1b" and cfg.recompute == "none" and not cfg.sequence_parallel
    assert cfg.dtype == ("bf16" if torch.cuda.is_available() else "fp32")  # CPU runs are fp32
    cfg = _config("--global-batch", "8", "--pp", "2", "--schedule", "interleaved-1f1b")
    assert cfg.virtual_stages == 2  # the default for interleaved schedules
    cfg = _config("--global-batch", "8", "--pp", "2", "--schedule", "interleaved-1f1b",
                  "--virtual-stages", "3")
    assert cfg.virtual_stages == 3
    cfg = _config("--global-batch", "16", "--dp", "2", "--tp", "2", "--micro-batch", "2",
                  "--zero", "3", "--recompute", "selective", "--sequence-parallel",
                  "--dtype", "bf16")
    assert (cfg.dp, cfg.tp, cfg.micro_batch, cfg.zero) == (2, 2, 2, 3)
    assert cfg.recompute == "selective" and cfg.sequence_parallel and cfg.dtype == "bf16"
    with pytest.raises(AutoparError, match="--global-batch"):
        _config()


def _spec(**kw):
    args = dict(world_size=4, nnodes=1, node_rank=0, rdzv_endpoint="", nproc_per_node=None,
                max_restarts=0)
    return launch_spec_for(**{**args, **kw})


def test_torchrun_command_one_node_and_several():
    cmd = torchrun_command(_spec(max_restarts=2), "args.json")
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in cmd and "--standalone" in cmd and "--max-restarts=2" in cmd
    assert cmd[-3:] == ["-m", "autopar.runtime.worker", "args.json"]
    cmd = torchrun_command(_spec(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500"), "a")
    assert "--standalone" not in cmd and "--nproc-per-node=2" in cmd
    for flag in ("--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29500", "--nnodes=2",
                 "--node-rank=1"):
        assert flag in cmd, flag


@pytest.mark.parametrize("endpoint", ["10.0.0.1:29500", "node-0.cluster:1", "[fe80::1]:29500",
                                      "node_01:29500"])
def test_launch_takes_host_port_endpoints(endpoint):
    assert _spec(nnodes=2, nproc_per_node=2, rdzv_endpoint=endpoint).rdzv_endpoint == endpoint


@pytest.mark.parametrize(("kw", "error", "needle"), [
    (dict(nproc_per_node=3), PlanMismatchError, "the plan needs 4 processes"),
    (dict(nnodes=3, rdzv_endpoint="h:1"), PlanMismatchError, "the plan needs 4 processes"),
    (dict(nnodes=2), AutoparError, "needs --rdzv-endpoint"),
    (dict(nnodes=2, node_rank=2, rdzv_endpoint="h:1"), AutoparError, "not in 0..1"),
    (dict(max_restarts=-1), AutoparError, "--max-restarts"),
    # torchrun retries an endpoint it cannot parse without end
    (dict(rdzv_endpoint="garbage"), AutoparError, "is not HOST:PORT"),
    (dict(rdzv_endpoint="host:99999"), AutoparError, "is not HOST:PORT"),
    (dict(rdzv_endpoint="host:0"), AutoparError, "is not HOST:PORT"),
    (dict(rdzv_endpoint="a b:1"), AutoparError, "is not HOST:PORT"),
])
def test_launch_geometry_errors(kw, error, needle):
    with pytest.raises(error, match=needle) as info:
        _spec(**kw)
    assert "\n" not in str(info.value)
