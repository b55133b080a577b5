"""Dropout under tensor parallelism: the ranks of a tp group draw the same masks on the
replicated activations (the embedding's and the residual's dropout), so the parameters they
replicate stay identical, and the same seed gives the same run (``runtime/apply.py``
``_seeded``, ``mesh.random_ops_seed``; ``autopar run`` reseeds every step from (seed, step))."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.distributed

MODEL = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq_len=16,dropout=0.1"


def _train(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    from autopar.config import ParallelConfig
    from autopar.cost_model.hardware import Cluster
    from autopar.runtime import apply_plan, build_mesh
    from autopar.runtime.step import local_batch, train_step
    from autopar.runtime.verify import model_profile
    from autopar.runtime.worker import build_model
    from autopar.search import plan_from_config

    torch.manual_seed(100 + rank)  # processes that start from different generators
    plan = plan_from_config(model_profile(MODEL), Cluster.preset("cpu", gpus_per_node=2),
                            ParallelConfig(tp=2, global_batch=4, dtype="fp32"), model=MODEL)
    pm = apply_plan(build_model(MODEL, device="cpu", seed=0), plan, build_mesh(plan, "cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, 64, (4, 16), generator=gen)
        losses.append(train_step(pm, local_batch(pm, tokens), local_batch(pm, tokens), opt))
    replicated = {}
    for part in pm.model_parts:
        for fqn, param in part.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if not isinstance(param, DTensor) or all(p.is_replicate() for p in param.placements):
                replicated[fqn] = local.detach().clone()
    return {"losses": losses, "replicated": replicated}


@pytest.mark.timeout(120)
def test_tp_ranks_agree_on_dropout_and_runs_repeat(run_distributed: Any) -> None:
    import torch

    first = run_distributed(_train, 2)
    again = run_distributed(_train, 2)
    assert first[0]["replicated"], "no replicated parameter to compare"
    for fqn, value in first[0]["replicated"].items():
        assert torch.equal(value, first[1]["replicated"][fqn]), fqn
    assert first[0]["losses"] == again[0]["losses"]


@pytest.mark.timeout(120)
def test_autopar_run_with_dropout_repeats_its_losses() -> None:
    """`autopar run` seeds each step's random ops from (seed, step): the same seed gives the
    same losses (each process had drawn its masks from its own generator), another seed
    others."""
    import json

    from tests.processes import run_autopar

    def losses(seed: str) -> list[float]:
        proc = run_autopar("run", MODEL, "--tp", "2", "--global-batch", "4", "--steps", "2",
                           "--seed", seed, "--json", timeout_s=100)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)["losses"]

    first = losses("1")
    assert first == losses("1") != losses("2")
