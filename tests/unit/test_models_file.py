"""Model files: the convention, and one clear ModelFileError per way a file can be broken."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar import load_model_file
from autopar.errors import ModelFileError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"

GOOD_TAIL = """
import torch
def build_model():
    return torch.nn.Linear(4, 4)
def example_inputs(batch_size):
    return torch.zeros(batch_size, 4)
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(text)
    return path


def test_example_file_loads_and_runs():
    mf = load_model_file(FIXTURES / "tiny_mlp.py")
    meta = mf.instantiate()
    assert next(meta.parameters()).device.type == "meta"
    a = mf.instantiate("cpu", seed=3)
    b = mf.instantiate("cpu", seed=3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    batch = mf.example_inputs(2)
    loss = mf.loss_fn(a(batch), batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert mf.instantiate(dtype=torch.bfloat16).output.weight.dtype == torch.bfloat16


def test_loss_fn_is_optional(tmp_path):
    mf = load_model_file(write(tmp_path, GOOD_TAIL))
    assert mf.loss_fn is None
    assert mf.build_model().weight.shape == (4, 4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("def build_model(:\n    pass\n", r"syntax error at line 1"),
        ("x = 1\nimport not_a_real_package_xyz\n", r"import \(line 2\).*not_a_real_package"),
        ("raise RuntimeError('boom')\n", r"raised RuntimeError: boom while loading \(line 1\)"),
        ("def example_inputs(b):\n    return None\n", r"defines no build_model\(\)"),
        ("x = 1\n", r"defines no build_model\(\) and no example_inputs\(\)"),
        ("build_model = 3\ndef example_inputs(b):\n    return None\n", r"defines no build_model"),
        (GOOD_TAIL + "loss_fn = 3\n", "loss_fn must be a function"),
    ],
)
def test_broken_files(tmp_path, text, message):
    with pytest.raises(ModelFileError, match=message) as info:
        load_model_file(write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="does not exist"):
        load_model_file(tmp_path / "nope.py")


def test_build_model_that_raises_names_the_exception(tmp_path):
    path = write(
        tmp_path,
        "def build_model():\n    raise ValueError('hidden must be even')\n"
        "def example_inputs(b):\n    return 1 / 0\n",
    )
    mf = load_model_file(path)
    expected = r"build_model\(\) in .* raised ValueError: hidden must be even \(line 2\)"
    with pytest.raises(ModelFileError, match=expected):
        mf.instantiate()
    with pytest.raises(ModelFileError, match=r"example_inputs\(\) .* raised ZeroDivisionError"):
        mf.example_inputs(2)


def test_file_may_define_dataclasses(tmp_path):
    text = "from dataclasses import dataclass\n@dataclass\nclass Cfg:\n    width: int = 4\n"
    text += GOOD_TAIL
    assert load_model_file(write(tmp_path, text)).build_model() is not None
