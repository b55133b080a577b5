"""Checkpoint manifests: written last, checked before any load; resume falls back past bad ones.

Pure file-system tests (no process group): fake checkpoints are directories of files with a
manifest written by ``write_manifest``, as ``save_checkpoint`` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.errors import AutoparError
from autopar.runtime.checkpoint import check_checkpoint_dir
from autopar.runtime.manifest import (
    MANIFEST_NAME,
    NOT_AUTOPAR,
    find_resume_point,
    manifest_problem,
    write_manifest,
)


def _fake_checkpoint(root: Path, step: int, *, manifest: bool = True) -> Path:
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"metadata of step %d" % step)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * (step + 1))
    if manifest:
        write_manifest(path, {"step": step, "world_size": 1})
    return path


def test_manifest_lists_every_file_and_verifies(tmp_path):
    path = _fake_checkpoint(tmp_path, 3)
    doc = json.loads((path / MANIFEST_NAME).read_text())
    assert sorted(doc["files"]) == [".metadata", "__0_0.distcp"]
    assert doc["step"] == 3 and len(doc["files"][".metadata"]["sha256"]) == 64
    assert manifest_problem(path) is None
    assert not list(path.glob("*.tmp")), "the manifest's temporary file is renamed away"


@pytest.mark.parametrize("damage, needle", [
    (lambda p: (p / "__0_0.distcp").write_bytes(b"short"), "has 5 bytes"),
    (lambda p: (p / "__0_0.distcp").write_bytes(b"\0" * 1024), "does not match its sha256"),
    (lambda p: (p / "__0_0.distcp").unlink(), "is missing"),
    (lambda p: (p / "extra.bin").write_bytes(b"x"), "not in the manifest"),
    (lambda p: (p / MANIFEST_NAME).write_text("{not json"), "unreadable manifest"),
    (lambda p: (p / MANIFEST_NAME).write_text('{"files": {"../x": {}}}'), "unreadable manifest"),
    (lambda p: (p / MANIFEST_NAME).write_text("[" * 100_000), "unreadable manifest"),
    (lambda p: (p / MANIFEST_NAME).unlink(), NOT_AUTOPAR),
])
def test_damage_is_found(tmp_path, damage, needle):
    path = _fake_checkpoint(tmp_path, 3)
    damage(path)
    problem = manifest_problem(path)
    assert problem is not None and needle in problem, problem


def test_hashes_are_shared_between_ranks(tmp_path):
    path = _fake_checkpoint(tmp_path, 3)
    (path / "__0_0.distcp").write_bytes(b"\1" * 1024)  # same size, other bytes
    # Sorted files: .metadata (rank 0's share of 2), __0_0.distcp (rank 1's share).
    assert manifest_problem(path, rank=0, world_size=2) is None
    assert "does not match" in manifest_problem(path, rank=1, world_size=2)


def test_resume_point_falls_back_to_newest_verified(tmp_path):
    _fake_checkpoint(tmp_path, 1)
    _fake_checkpoint(tmp_path, 2)
    (_fake_checkpoint(tmp_path, 3) / "__0_0.distcp").write_bytes(b"torn")
    (tmp_path / "step_4").mkdir()  # renamed, never finished (no files)
    (tmp_path / "step_5.tmp").mkdir()
    point = find_resume_point(tmp_path, trust=False)
    assert point.step == 2
    assert [s.split(" ")[0] for s in point.skipped] == ["step_4", "step_3"]
    assert "step_3" in point.note() and "step_4" in point.note()
    assert len(point.note().splitlines()) == 1


def test_foreign_checkpoint_needs_trust(tmp_path):
    _fake_checkpoint(tmp_path, 1, manifest=False)
    point = find_resume_point(tmp_path, trust=False)
    assert point.step is None and NOT_AUTOPAR in point.skipped[0]
    trusted = find_resume_point(tmp_path, trust=True)
    assert trusted.step == 1 and trusted.unverified
    # A checkpoint with a manifest that fails is never loaded, trusted or not.
    (_fake_checkpoint(tmp_path, 2) / ".metadata").write_bytes(b"other metadata!!")
    assert find_resume_point(tmp_path, trust=True).step == 1


def _check(directory, *, trust=False, steps=10):
    return check_checkpoint_dir(str(directory), resume=True, steps=steps, every=0, trust=trust)


def test_launch_check_refuses_foreign_and_unverified(tmp_path):
    _fake_checkpoint(tmp_path, 1, manifest=False)
    with pytest.raises(AutoparError, match="--trust-checkpoint") as err:
        _check(tmp_path)
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)
    assert _check(tmp_path, trust=True).step == 1
    bad = tmp_path / "bad"
    (_fake_checkpoint(bad, 2) / "__0_0.distcp").write_bytes(b"torn")
    with pytest.raises(AutoparError, match="no complete checkpoint that verifies") as err:
        _check(bad)
    assert "step_2" in str(err.value) and "--checkpoint-dir" in str(err.value)


def test_launch_check_notes_what_it_skipped(tmp_path):
    _fake_checkpoint(tmp_path, 1)
    (_fake_checkpoint(tmp_path, 2) / "__0_0.distcp").unlink()
    point = _check(tmp_path)
    assert point.step == 1 and "step_2" in point.note()
    with pytest.raises(AutoparError, match="past --steps"):
        _check(tmp_path, steps=0)
    # at --steps: nothing to train (it launched workers that trained "steps 2..1")
    with pytest.raises(AutoparError, match=r"already at --steps 1; .* --steps 2 or more"):
        _check(tmp_path, steps=1)


def test_trust_goes_with_resume(tmp_path):
    with pytest.raises(AutoparError, match="--trust-checkpoint goes with --resume"):
        check_checkpoint_dir(str(tmp_path), resume=False, steps=2, every=0, trust=True)
