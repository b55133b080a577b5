"""Checkpoints of expert-parallel runs: each rank holds different experts under one name, so the
checkpoint stores them as one whole [E, ...] tensor (``expert_parallel.expert_state_views``) and
loads under any split. ``autopar run`` of a zoo mixture of experts saves after 2 steps under
dp 2 x ep 2 (experts whole on each rank), under dp 4 x ep 2 zero 1 (FSDP2 shards of each
rank's experts) and under dp 2 x tp 2 x ep 2 (both tp ranks of a dp rank hold the same experts),
and resumes to step 4 under another split: the losses of steps 3 and 4 equal the uninterrupted
one-process run's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_run_train import rel_diff, run_json

pytestmark = pytest.mark.distributed

MODEL = "llama:layers=2,hidden=32,heads=4,kv_heads=2,vocab=64,seq_len=16,experts=4,top_k=2"
BATCH = ["--global-batch", "4"]
EP2 = ["--dp", "2", "--ep", "2", "--zero", "0"]
EP2_FSDP = ["--dp", "4", "--ep", "2", "--zero", "1"]
EP2_TP2 = ["--dp", "2", "--tp", "2", "--ep", "2", "--zero", "1"]


def _save(tmp_path: Path, split: list[str]) -> Path:
    ckpt = tmp_path / "ckpt"
    run = run_json(MODEL, *BATCH, *split, "--steps", "2", "--checkpoint-dir", str(ckpt))
    assert run["steps"] == [1, 2]
    return ckpt


def _resume(ckpt: Path, split: list[str], reference: dict) -> None:
    run = run_json(MODEL, *BATCH, *split, "--steps", "4", "--checkpoint-dir", str(ckpt),
                   "--resume")
    assert run["steps"] == [3, 4]
    assert rel_diff(run["losses"], reference["losses"][2:]) < 1e-6, (run, reference)


@pytest.mark.timeout(600)
def test_expert_parallel_checkpoints_resume_under_any_split(tmp_path: Path) -> None:
    reference = run_json(MODEL, *BATCH, "--steps", "4")
    whole = _save(tmp_path / "whole", EP2)
    other = tmp_path / "whole_copy"
    shutil.copytree(whole, other)
    _resume(whole, EP2_FSDP, reference)  # each rank's experts whole -> FSDP2 shards of them
    _resume(other, [], reference)  # -> one process, all experts
    sharded = _save(tmp_path / "sharded", EP2_FSDP)
    _resume(sharded, EP2_TP2, reference)  # FSDP2 shards -> experts whole on both tp ranks
    with_tp = _save(tmp_path / "with_tp", EP2_TP2)  # the tp ranks hold the same experts
    _resume(with_tp, EP2, reference)
