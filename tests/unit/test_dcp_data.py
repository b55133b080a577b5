"""Checkpoints load as data: DCP metadata and non-tensor items build nothing they name beyond
DCP's own records (runtime/dcp_data.py), and a run for another model is refused before launch."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from autopar.errors import AutoparError
from autopar.runtime.checkpoint import check_checkpoint_dir, model_problem
from autopar.runtime.dcp_data import DataOnlyPlanner, DataOnlyReader, read_metadata_bytes

CALLS: list[str] = []


def _record(text: str) -> str:
    CALLS.append(text)
    return text


class _Payload:
    def __reduce__(self):
        return (_record, ("ran",))


def _save(path: Path) -> dict:
    state = {"model.w": torch.arange(6.0).view(2, 3), "model.b": torch.zeros(3),
             "optim.lr": 0.01, "optim.betas": (0.9, 0.95), "optim.step": 3}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def test_a_dcp_checkpoint_loads_through_the_data_only_reader(tmp_path: Path) -> None:
    saved = _save(tmp_path / "step_1")
    state = {"model.w": torch.empty(2, 3), "model.b": torch.ones(3), "optim.lr": 0.0,
             "optim.betas": (0.0, 0.0), "optim.step": 0}
    dcp.load(state, storage_reader=DataOnlyReader(tmp_path / "step_1"),
             planner=DataOnlyPlanner(), no_dist=True)
    assert torch.equal(state["model.w"], saved["model.w"])
    assert torch.equal(state["model.b"], saved["model.b"])
    assert (state["optim.lr"], tuple(state["optim.betas"]), state["optim.step"]) == (
        0.01, (0.9, 0.95), 3)


def test_metadata_naming_anything_else_is_refused_without_running_it(tmp_path: Path) -> None:
    _save(tmp_path / "step_1")
    metadata = read_metadata_bytes((tmp_path / "step_1" / ".metadata").read_bytes())
    metadata.storage_meta = _Payload()  # type: ignore[assignment]
    forged = pickle.dumps(metadata)
    with pytest.raises(AutoparError, match=r"names .*_record, which DCP's metadata does not"):
        read_metadata_bytes(forged)
    (tmp_path / "step_1" / ".metadata").write_bytes(forged)
    with pytest.raises(CheckpointException, match="_record"):  # DCP wraps the refusal
        dcp.load({"model.w": torch.empty(2, 3)}, no_dist=True,
                 storage_reader=DataOnlyReader(tmp_path / "step_1"), planner=DataOnlyPlanner())
    assert CALLS == []
    for junk in (b"not a pickle", pickle.dumps({"a": 1})):
        with pytest.raises(AutoparError, match=r"\.metadata"):
            read_metadata_bytes(junk)


def test_a_checkpoint_of_another_model_is_named_before_launch(tmp_path: Path) -> None:
    _save(tmp_path / "step_1")
    assert model_problem(tmp_path, 1, {"w": (2, 3), "b": (3,)}) is None
    problem = model_problem(tmp_path, 1, {"w": (4, 3), "b": (3,), "c": (1,)})
    assert problem is not None
    assert "w is [2, 3] there, [4, 3] here; it lacks c" in problem
    assert "it holds b" in model_problem(tmp_path, 1, {"w": (2, 3)})


def test_a_checkpoint_dir_that_cannot_be_created_is_refused_before_training(
        tmp_path: Path) -> None:
    (tmp_path / "file.json").write_text(json.dumps({}))
    with pytest.raises(AutoparError, match=r"file\.json is not a directory"):
        check_checkpoint_dir(str(tmp_path / "file.json" / "ck"), resume=False, steps=1, every=0)
    assert check_checkpoint_dir(str(tmp_path / "new" / "ck"), resume=False, steps=1,
                                every=0).step is None


def test_metadata_pickled_by_other_pythons_loads(tmp_path: Path) -> None:
    """Python 3.11.0-3.11.3 pickle an enum member as getattr(cls, name) (DCP's memory-format
    enum is in every tensor's properties), Python 3.13 names pathlib._local's paths: both read;
    a getattr of anything else does not."""
    import copyreg
    import enum
    import io

    _save(tmp_path / "step_1")
    metadata = read_metadata_bytes((tmp_path / "step_1" / ".metadata").read_bytes())

    class OldEnumPickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    buffer = io.BytesIO()
    OldEnumPickler(buffer).dump(metadata)
    assert b"getattr" in buffer.getvalue()
    again = read_metadata_bytes(buffer.getvalue())
    assert again.state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    with pytest.raises(AutoparError, match="not DCP metadata"):
        read_metadata_bytes(b"cpathlib._local\nPosixPath\n(S'/tmp/x'\ntR.")
    evil = io.BytesIO()
    pickle.Pickler(evil).dump(copyreg._reconstructor)  # any global: refused by name
    with pytest.raises(AutoparError, match=r"names copyreg\._reconstructor"):
        read_metadata_bytes(evil.getvalue())
    with pytest.raises(AutoparError, match="getattr on something other than"):
        read_metadata_bytes(b"cbuiltins\ngetattr\n(ccollections\nOrderedDict\n"
                            b"S'fromkeys'\ntR.")
