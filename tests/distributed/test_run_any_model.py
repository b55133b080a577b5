"""``autopar run`` of models the runtime cannot split (no top-level block container): data
parallelism runs them all. DDP (zero 0) and FSDP2 per repeated block (zero 3) over 2 processes give
the one-process losses for a model-file CNN (images, its own loss_fn), a model-file
encoder-decoder (keyword inputs), a model file without ``loss_fn`` whose model returns its own
``loss``, and a tiny Hugging Face Llama built from its config (blocks at
``model.layers``, the LM default loss on its ``.logits``). TP and PP stay refused, naming the part
that blocks them and the split that works.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "models"
# Two blocks, 4 heads over 2 kv heads, 64 tokens, 16 positions, untied head: no download.
HF_LLAMA = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
    "max_position_embeddings": 16, "tie_word_embeddings": False,
}


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "autopar.cli", "run", *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
                          check=False)


def _losses(model: str, *split: str) -> list[float]:
    proc = _run(model, *split, "--global-batch", "4", "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["losses"]


def _model(name: str, tmp_path: Path) -> str:
    if name == "hf-llama":
        path = tmp_path / "config.json"
        path.write_text(json.dumps(HF_LLAMA))
        return str(path)
    return str(FIXTURES / name)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory):
    """``reference(name) -> (model, losses)``: the ``--dp 1`` run of each model, run once."""
    folder = tmp_path_factory.mktemp("models")
    runs: dict[str, tuple[str, list[float]]] = {}

    def reference(name: str) -> tuple[str, list[float]]:
        if name not in runs:
            model = _model(name, folder)
            runs[name] = (model, _losses(model, "--dp", "1"))
        return runs[name]

    return reference


@pytest.mark.timeout(60)
@pytest.mark.parametrize("zero", ["0", "3"])
@pytest.mark.parametrize("name", ["tiny_cnn.py", "tiny_seq2seq.py", "tiny_own_loss.py",
                                  "hf-llama"])
def test_dp_and_fsdp_equal_one_process(name: str, zero: str, one_process) -> None:
    model, reference = one_process(name)
    assert len(reference) == 2 and reference[0] != reference[1]
    losses = _losses(model, "--dp", "2", "--zero", zero)
    assert losses == pytest.approx(reference, rel=1e-5), (zero, losses, reference)


@pytest.mark.timeout(100)
@pytest.mark.parametrize(
    ("name", "split", "part"),
    [
        ("tiny_cnn.py", ("--tp", "2"), "'stages'"),
        ("tiny_seq2seq.py", ("--pp", "2"), "'decoder.layers'"),
        ("hf-llama", ("--dp", "2", "--pp", "2"), "'model.layers'"),
    ],
)
def test_tp_and_pp_refused_naming_the_part_and_the_dp_split(
    name: str, split: tuple[str, ...], part: str, tmp_path: Path
) -> None:
    proc = _run(_model(name, tmp_path), *split, "--global-batch", "4", "--steps", "1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    world = 1
    for flag, value in zip(split[::2], split[1::2]):
        world *= int(value) if flag in ("--dp", "--tp", "--pp") else 1
    assert part in line and f"--dp {world}" in line, line
