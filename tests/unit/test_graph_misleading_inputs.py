"""Model files whose inputs would make a profile count the wrong thing: fp32 images under bf16
training (counted at the training dtype), and a nanoGPT-shaped forward that, given no targets,
returns the last position's logits only (one warning line naming the fix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.graph.model_text import build_and_profile

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"

# A CNN whose forward feeds the images straight to its first convolution (no cast of its own).
CNN = '''
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.relu(self.conv1(x)))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stages = nn.ModuleList(Block() for _ in range(2))
        self.fc = nn.Linear(8, 10)

    def forward(self, images):
        h = self.stem(images)
        for block in self.stages:
            h = block(h)
        return self.fc(h.mean(dim=(2, 3)))


def build_model():
    return CNN()


def example_inputs(batch_size):
    return torch.randn(batch_size, 3, 16, 16)
'''


def test_fp32_images_are_profiled_at_the_training_dtype(tmp_path, capsys):
    path = tmp_path / "cnn.py"
    path.write_text(CNN)
    bf16 = build_and_profile(str(path), dtype="bf16")[1]
    fp32 = build_and_profile(str(path), dtype="fp32")[1]
    assert [layer.name for layer in bf16.layers] == ["embedding", "stages.0", "stages.1", "head"]
    for low, full in zip(bf16.layers, fp32.layers, strict=True):
        assert low.saved_bytes["none"] * 2 == full.saved_bytes["none"], low.name
        assert low.output_bytes * 2 == full.output_bytes, low.name
    # the stem keeps its input image for backward: 3 x 16 x 16 values at 2 bytes
    assert bf16.layers[0].saved_bytes["none"] == 3 * 16 * 16 * 2
    assert capsys.readouterr().err == ""


def test_nanogpt_forward_without_targets_warns_once_naming_the_fix(capsys):
    profile = build_and_profile(str(MODELS / "tiny_nanogpt.py"))[1]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("autopar: warning: GPT's forward returned logits for 1 of 16 ")
    assert "example_inputs(batch_size) return (idx, targets)" in line
    assert "loss_fn(output, batch)" in line
    assert profile.layers[-1].name == "head"


def test_nanogpt_given_targets_profiles_every_position_without_warning(capsys):
    short = build_and_profile(str(MODELS / "tiny_nanogpt.py"))[1]
    capsys.readouterr()
    full = build_and_profile(str(MODELS / "tiny_nanogpt_targets.py"))[1]
    assert capsys.readouterr().err == ""
    # the output layer's matmul on all 16 positions instead of 1: 2 x 32 x 128 flops each
    assert full.layers[-1].fwd_flops == 16 * 2 * 32 * 128
    assert short.layers[-1].fwd_flops == 1 * 2 * 32 * 128
    assert full.layers[-1].saved_bytes["none"] > 10 * short.layers[-1].saved_bytes["none"]


@pytest.mark.parametrize("name", ["tiny_cnn.py", "tiny_own_loss.py", "tiny_seq2seq.py"])
def test_other_model_files_profile_without_warning(name, capsys):
    build_and_profile(str(MODELS / name))
    assert "warning" not in capsys.readouterr().err
