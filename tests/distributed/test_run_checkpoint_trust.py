"""``autopar run --resume`` loads, as data, only checkpoints whose manifest verifies (or trusted).

DCP's ``.metadata`` is a pickle, so loading a checkpoint can run code: a checkpoint directory
autopar did not write is refused before any worker starts unless ``--trust-checkpoint`` is
given, and a damaged newest checkpoint is skipped for the newest one that verifies.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
from test_run_train import BATCH, MODEL, autopar_run

from tests.helpers import one_error_line

pytestmark = pytest.mark.distributed


class _Trap:
    """Unpickling this creates a file: what a hostile ``.metadata`` could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _one_error_line(proc, needle: str) -> str:
    return one_error_line(proc.returncode, proc.stdout, proc.stderr, needle)


@pytest.mark.timeout(120)
def test_foreign_checkpoint_is_not_unpickled(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_1").mkdir(parents=True)
    sentinel = tmp_path / "code_ran"
    (ckpt / "step_1" / ".metadata").write_bytes(pickle.dumps(_Trap(str(sentinel))))
    (ckpt / "step_1" / "__0_0.distcp").write_bytes(b"\0" * 64)
    # The completion marker of autopar's earlier checkpoints: anyone can write it.
    (ckpt / "step_1" / "COMPLETE").write_text('{"step": 1}')
    proc = autopar_run(MODEL, *BATCH, "--steps", "2", "--checkpoint-dir", str(ckpt), "--resume")
    line = _one_error_line(proc, "--trust-checkpoint")
    assert str(ckpt) in line
    assert not sentinel.exists(), "the checkpoint's pickle ran"


@pytest.mark.timeout(600)
def test_damaged_newest_falls_back_and_trust_loads_foreign(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = autopar_run(MODEL, *BATCH, "--steps", "2", "--checkpoint-dir", str(ckpt),
                        "--checkpoint-every", "1", "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    losses = json.loads(first.stdout)["losses"]
    foreign = tmp_path / "foreign"
    shutil.copytree(ckpt, foreign)
    # A torn shard in the newest checkpoint: resume from step_1, with one note naming step_2.
    shard = next((ckpt / "step_2").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    proc = autopar_run(MODEL, *BATCH, "--steps", "3", "--checkpoint-dir", str(ckpt), "--resume",
                       "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [ln for ln in proc.stderr.splitlines() if ln.startswith("autopar: note:")]
    assert len(notes) == 1 and "step_2" in notes[0] and shard.name in notes[0], notes
    resumed = json.loads(proc.stdout)
    assert resumed["steps"] == [2, 3] and resumed["losses"][0] == losses[1]
    # Checkpoints without manifests: refused, then loaded with --trust-checkpoint.
    for manifest in foreign.glob("step_*/MANIFEST.json"):
        manifest.unlink()
    base = [MODEL, *BATCH, "--steps", "3", "--checkpoint-dir", str(foreign), "--resume"]
    _one_error_line(autopar_run(*base), "--trust-checkpoint")
    trusted = autopar_run(*base, "--trust-checkpoint", "--json")
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    doc = json.loads(trusted.stdout)
    assert doc["steps"] == [3] and doc["losses"] == resumed["losses"][1:]
    assert (foreign / "step_3" / "MANIFEST.json").is_file()


@pytest.mark.timeout(300)
def test_a_forged_manifest_runs_no_code_and_another_models_checkpoint_is_named(
        tmp_path: Path) -> None:
    """The manifest is no signature: a checkpoint whose pickle was replaced and whose manifest
    was rewritten to match still runs no code (runtime/dcp_data.py reads it as data), and a
    checkpoint of another model is refused before launch, not in the workers."""
    from autopar.runtime.dcp_data import read_metadata_bytes
    from autopar.runtime.manifest import MANIFEST_NAME, write_manifest

    ckpt = tmp_path / "ckpt"
    first = autopar_run(MODEL, *BATCH, "--steps", "1", "--checkpoint-dir", str(ckpt))
    assert first.returncode == 0, first.stderr[-3000:]
    wider = MODEL.replace("hidden=32", "hidden=64")
    line = _one_error_line(autopar_run(wider, *BATCH, "--steps", "2", "--checkpoint-dir",
                                       str(ckpt), "--resume"), "was written for another model")
    assert "tok_embeddings.weight is [64, 32] there, [64, 64] here" in line
    step = ckpt / "step_1"
    metadata = read_metadata_bytes((step / ".metadata").read_bytes())
    sentinel = tmp_path / "code_ran"
    metadata.storage_meta = _Trap(str(sentinel))
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    facts = json.loads((step / MANIFEST_NAME).read_text())
    write_manifest(step, {k: v for k, v in facts.items() if k not in ("format", "files")})
    proc = autopar_run(MODEL, *BATCH, "--steps", "2", "--checkpoint-dir", str(ckpt), "--resume")
    _one_error_line(proc, "which DCP's metadata does not hold")
    assert not sentinel.exists(), "the checkpoint's pickle ran"
