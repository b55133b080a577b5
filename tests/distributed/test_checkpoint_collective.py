"""``save_checkpoint`` / ``load_latest_checkpoint`` on 2 gloo ranks: shared hashing, one verdict.

The ranks hash disjoint shares of a checkpoint's files; a file damaged in one rank's share makes
every rank skip that checkpoint, and both load the same older one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed


def _save_damage_load(rank: int, world_size: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from autopar.runtime.checkpoint import load_latest_checkpoint, save_checkpoint
    from autopar.runtime.manifest import manifest_problem

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    saved = {}
    for step in (1, 2):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        save_checkpoint(root, step, [model], [optimizer], marker={"world_size": world_size})
        saved[step] = model.weight.detach().clone()
    newest = Path(root) / "step_2"
    files = sorted(p.name for p in newest.iterdir() if p.name != "MANIFEST.json")
    damaged = files[1]  # in rank 1's share of the sorted files
    if rank == 0:
        data = (newest / damaged).read_bytes()
        (newest / damaged).write_bytes(bytes(b ^ 0xFF for b in data))  # same size
    dist.barrier()
    with torch.no_grad():
        model.weight.zero_()
    point = load_latest_checkpoint(root, [model], [optimizer], trust=False)
    return {
        "step": point.step,
        "skipped": point.skipped,
        "equal": torch.equal(model.weight, saved[1]),
        "own_share_problem": manifest_problem(newest, rank=rank, world_size=world_size),
        "damaged": damaged,
    }


@pytest.mark.timeout(180)
def test_damage_in_one_share_is_skipped_by_all_ranks(run_distributed, tmp_path: Path) -> None:
    results = run_distributed(_save_damage_load, 2, str(tmp_path / "ckpt"), timeout_s=150)
    assert [r["step"] for r in results] == [1, 1]
    assert all(r["equal"] for r in results)
    assert results[0]["own_share_problem"] is None  # rank 0 alone would not have seen it
    assert results[1]["damaged"] in results[1]["own_share_problem"]
    assert results[0]["skipped"] == results[1]["skipped"]
    assert results[0]["damaged"] in results[0]["skipped"][0]
