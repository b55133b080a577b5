"""A plan naming a ``.py`` model runs that file only when the user names it with ``--model``.

A plan JSON is data: ``explain``, ``run`` and ``verify`` of a plan whose ``model`` field is a
model file refuse (one line, exit 2, the file not imported) unless ``--model FILE`` is given.
Zoo names and HF config JSONs are data and need no flag.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.cli import main
from tests.helpers import one_error_line

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "tiny_mlp.py"
# Appended to the tiny MLP: importing the file leaves a trace next to it.
TRACE = "\nfrom pathlib import Path as _P\n_P(__file__).with_suffix('.ran').write_text('ran')\n"


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(model file, its plan JSON, the trace file the model writes when imported)."""
    root = tmp_path_factory.mktemp("trust")
    model = root / "model.py"
    model.write_text(FIXTURE.read_text() + TRACE)
    plan = root / "plan.json"
    code = main(["plan", str(model), "--gpus", "2", "--global-batch", "8", "--out", str(plan)])
    assert code == 0
    assert json.loads(plan.read_text())["model"] == str(model)
    return model, plan, model.with_suffix(".ran")


def _refused(capfd: pytest.CaptureFixture[str], code: int, trace: Path) -> str:
    line = one_error_line(code, *capfd.readouterr(), "names a model file")
    assert "--model" in line, line
    assert not trace.exists(), "the plan's model file ran"
    return line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["explain"], ["verify"], ["run", "--steps", "1"]])
def test_plan_model_file_needs_model_flag(planned, capfd, command):
    model, plan, trace = planned
    trace.unlink(missing_ok=True)
    code = main([command[0], str(plan), *command[1:]])
    line = _refused(capfd, code, trace)
    assert str(model) in line


@pytest.mark.timeout(120)
def test_explicit_model_flag_runs_the_file(planned, capfd):
    model, plan, trace = planned
    trace.unlink(missing_ok=True)
    assert main(["explain", str(plan), "--model", str(model)]) == 0
    assert trace.exists()
    capfd.readouterr()


@pytest.mark.timeout(120)
def test_zoo_and_hf_plans_need_no_flag(tmp_path, capfd):
    plan = tmp_path / "zoo.json"
    zoo = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq_len=16"
    assert main(["plan", zoo, "--gpus", "2", "--global-batch", "8", "--out", str(plan)]) == 0
    assert main(["explain", str(plan)]) == 0
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
                                  "vocab_size": 256, "n_positions": 32}))
    hf_plan = tmp_path / "hf.json"
    assert main(["plan", str(config), "--gpus", "2", "--global-batch", "8",
                 "--out", str(hf_plan)]) == 0
    assert main(["explain", str(hf_plan)]) == 0
    capfd.readouterr()
