"""``autopar run`` of any model: data parallelism runs them all, tp and pp the decoder LMs.

DDP (zero 0) and FSDP2 per repeated block (zero 3) over 2 processes give the one-process losses for
a model-file CNN (images, its own loss_fn), a model-file encoder-decoder (keyword inputs), a model
file without ``loss_fn`` whose model returns its own ``loss``, and a tiny Hugging Face Llama built
from its config (blocks at ``model.layers``, the LM default loss on its ``.logits``). The HF Llama
under tp 2 with sequence parallelism (the layout ``autopar plan`` finds in the profile) and the
nanoGPT-shaped file (blocks at ``transformer.h``) under pp 2, and Hugging Face GPT-2 with its
lm head tied to the token embedding under tp 2 and pp 2, give them too. What stays refused names
the part that blocks the split and the split that works: tp / pp of the CNN (no token embedding)
and of the encoder-decoder (a second block stack), FSDP of a fused q/k/v split.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.processes import run_autopar

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "models"
# Two blocks, 4 heads over 2 kv heads, 64 tokens, 16 positions, untied head: no download.
HF_LLAMA = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
    "max_position_embeddings": 16, "tie_word_embeddings": False,
}
# GPT-2 with its default tied lm head (no dropout: every split draws the same nothing).
HF_GPT2_TIED = {
    "model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64,
    "n_positions": 16, "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0,
    "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}

# BLOOM: its attention is the block's `self_attention` (as Falcon's), which selective
# recompute wraps.
HF_BLOOM = {
    "model_type": "bloom", "hidden_size": 32, "n_head": 4, "n_layer": 2, "vocab_size": 64,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_position_embeddings": 16,
}


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_autopar("run", *args, timeout_s=120)


def _losses(model: str, *split: str) -> list[float]:
    proc = _run(model, *split, "--global-batch", "4", "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["losses"]


def _model(name: str, tmp_path: Path) -> str:
    configs = {"hf-llama": HF_LLAMA, "hf-gpt2-tied": HF_GPT2_TIED, "hf-bloom": HF_BLOOM}
    if name in configs:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(configs[name]))
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


@pytest.mark.timeout(120)  # the first case of a model also runs its one-process reference
@pytest.mark.parametrize("zero", ["0", "3"])
@pytest.mark.parametrize("name", ["tiny_cnn.py", "tiny_seq2seq.py", "tiny_own_loss.py",
                                  "hf-llama"])
def test_dp_and_fsdp_equal_one_process(name: str, zero: str, one_process) -> None:
    model, reference = one_process(name)
    assert len(reference) == 2 and reference[0] != reference[1]
    losses = _losses(model, "--dp", "2", "--zero", zero)
    assert losses == pytest.approx(reference, rel=1e-5), (zero, losses, reference)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("name", "split"),
    [
        ("hf-llama", ("--tp", "2", "--sequence-parallel")),
        ("tiny_nanogpt_split.py", ("--pp", "2")),
        # The tied head: one vocab-parallel weight under tp; two copies under pp whose
        # gradients are summed (runtime/tied_weights.py).
        ("hf-gpt2-tied", ("--tp", "2", "--sequence-parallel")),
        ("hf-gpt2-tied", ("--pp", "2")),
        # nanoGPT's order: the head registered first, its weight assigned to the embedding.
        ("tiny_nanogpt_tied.py", ("--pp", "2")),
        ("hf-bloom", ("--dp", "2", "--recompute", "selective")),
        # planned without sequence parallelism (its embedding norm: TPStructure.sp_blocker)
        ("hf-bloom", ("--tp", "2")),
    ],
)
def test_decoders_split_equal_one_process(name: str, split: tuple[str, ...], one_process) -> None:
    model, reference = one_process(name)
    losses = _losses(model, *split)
    assert losses == pytest.approx(reference, rel=1e-5), (split, losses, reference)


@pytest.mark.timeout(100)
@pytest.mark.parametrize(
    ("name", "split", "part", "remedy"),
    [
        # Refused by the planner's own rules (framework_support.model_support), which the
        # split given on the command line goes through first.
        ("tiny_cnn.py", ("--tp", "2"), "blocks at 'stages'", "use tp=1"),
        ("tiny_seq2seq.py", ("--pp", "2"), "own example_inputs batches", "use pp=1"),
        ("tiny_nanogpt_split.py", ("--dp", "2", "--tp", "2", "--zero", "3"),
         "transformer.h.0.attn.c_attn", "--zero 0"),
    ],
)
def test_refusals_name_the_part_and_the_split_that_works(
    name: str, split: tuple[str, ...], part: str, remedy: str, tmp_path: Path
) -> None:
    proc = _run(_model(name, tmp_path), *split, "--global-batch", "4", "--steps", "1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("autopar: error:") and part in line and remedy in line, line
