"""Acceptance checks of the command line (issues 2 and 6), in process through ``autopar.cli.main``.

Each bad input must end with exit code 2 and one line ``autopar: error: ...`` on stderr naming the
problem, never a traceback; ``autopar plan --json`` must print exactly the plan ``autopar.plan()``
returns for the same inputs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import autopar
import autopar.plan  # the Plan module; must not shadow the package's plan() function
from autopar.cli import main
from autopar.cli.common import cluster_from_args, load_profile
from tests.helpers import one_error_line

TINY = "gpt:layers=4,hidden=64,heads=4,vocab=256,seq_len=32"
FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"

UNTRACEABLE = """
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        if x.sum() > 0:  # needs tensor values: cannot run on the meta device
            return x
        return self.lin(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([Gate(), Gate()])
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return Net()


def example_inputs(batch_size):
    return torch.zeros(batch_size, 8, dtype=torch.long)
"""

MODEL_FILE_CASES = [
    ("def build_model(:\n    pass\n", "syntax error at line 1"),
    ("import not_a_real_package_xyz\n", "failed to import (line 1)"),
    ("def example_inputs(b):\n    return None\n", "defines no build_model()"),
    (
        "def build_model():\n    raise ValueError('hidden must be even')\n"
        "def example_inputs(b):\n    return None\n",
        "raised ValueError: hidden must be even",
    ),
    (UNTRACEABLE, "module 'blocks.0' (Gate)"),
]


@pytest.mark.parametrize(("text", "needle"), MODEL_FILE_CASES,
                         ids=["syntax", "import", "no-build-model", "build-raises", "untraceable"])
def test_bad_model_files_end_with_one_line(tmp_path, capfd, text, needle):
    path = tmp_path / "model.py"
    path.write_text(text)
    code = main(["plan", str(path), "--gpus", "2", "--global-batch", "8", "--seq-len", "8"])
    line = one_error_line(code, *capfd.readouterr(), needle)
    if "Gate" in needle:  # the untraceable model: names the construct and the fix
        assert "Tensor.item()" in line and "shapes, not values" in line


def test_missing_model_file(tmp_path, capfd):
    code = main(["plan", str(tmp_path / "nope.py"), "--gpus", "2", "--global-batch", "8"])
    one_error_line(code, *capfd.readouterr(), "does not exist")


def _cluster(*argv: str):
    parser = argparse.ArgumentParser()
    from autopar.cli.common import add_cluster_arguments

    add_cluster_arguments(parser)
    return cluster_from_args(parser.parse_args(list(argv)))


def test_gpus_nodes_and_memory_semantics(tmp_path):
    assert (_cluster("--gpus", "4").nodes, _cluster("--gpus", "4").gpus_per_node) == (1, 4)
    c = _cluster("--gpus", "1024", "--gpu", "h100")
    assert (c.nodes, c.gpus_per_node, c.num_gpus, c.name) == (128, 8, 1024, "h100")
    c = _cluster("--nodes", "3")
    assert (c.nodes, c.gpus_per_node, c.name) == (3, 8, "a100-80g")
    c = _cluster("--gpus", "16", "--gpu", "h100", "--gpu-memory", "96")
    assert c.device.memory_bytes == pytest.approx(96e9, rel=0.08)  # GB or GiB, not the preset's
    assert c.device.memory_bytes != _cluster("--gpus", "16", "--gpu", "h100").device.memory_bytes
    path = tmp_path / "c.yaml"
    c.to_yaml(path)
    with pytest.raises(autopar.AutoparError, match="drop --gpus"):
        _cluster("--cluster", str(path), "--gpus", "8")
    assert _cluster("--cluster", str(path)).fingerprint() == c.fingerprint()


def test_gpus_and_nodes_are_exclusive(capfd):
    code = main(["plan", TINY, "--gpus", "8", "--nodes", "1", "--global-batch", "8"])
    one_error_line(code, *capfd.readouterr(), "argument --nodes: not allowed with argument --gpus")


@pytest.fixture(scope="module")
def tiny_profile():
    return load_profile(TINY, None)


def test_cli_plan_json_equals_autopar_plan(capfd, tiny_profile):
    assert callable(autopar.plan)  # the function, even after `import autopar.plan`
    cluster = autopar.Cluster.preset("a100-80g", nodes=1, gpus_per_node=4)
    assert main(["plan", TINY, "--gpus", "4", "--global-batch", "8", "--top-k", "1",
                 "--json"]) == 0
    out = capfd.readouterr().out
    best = autopar.plan(tiny_profile, cluster, global_batch=8, model=TINY)
    assert out == best.to_json()
    # The CLI's default --top-k 3 (for the alternatives) chooses the same plan.
    assert main(["plan", TINY, "--gpus", "4", "--global-batch", "8", "--json"]) == 0
    default = json.loads(capfd.readouterr().out)
    three = autopar.plan(tiny_profile, cluster, global_batch=8, model=TINY, top_k=3)[0]
    assert default == json.loads(three.to_json())
    library = json.loads(best.to_json())
    assert {k: v for k, v in default.items() if k != "search"} == {
        k: v for k, v in library.items() if k != "search"
    }


def test_estimate_errors_name_the_constraint(capfd):
    code = main(["estimate", TINY, "--tp", "3", "--global-batch", "8"])
    one_error_line(code, *capfd.readouterr(), "heads")
    code = main(["estimate", TINY, "--dp", "2", "--gpus", "4", "--global-batch", "8"])
    one_error_line(code, *capfd.readouterr(), "world size")
    code = main(["estimate", TINY, "--pp", "4", "--schedule", "1f1b", "--global-batch", "2"])
    one_error_line(code, *capfd.readouterr(), "1f1b needs")


def test_explain_refuses_an_edited_cluster(tmp_path, capfd):
    path = tmp_path / "p.json"
    assert main(["estimate", TINY, "--tp", "2", "--global-batch", "8", "--out", str(path)]) == 0
    report = capfd.readouterr().out  # estimate prints the same report as plan
    for needle in ("Split  dp=1 tp=2 pp=1", "Where the step time goes", "MFU", "Binding"):
        assert needle in report, needle
    assert main(["explain", str(path)]) == 0
    assert "=" in capfd.readouterr().out
    doc = json.loads(path.read_text())
    doc["cluster"]["memory_headroom_fraction"] = 0.5
    path.write_text(json.dumps(doc))
    code = main(["explain", str(path)])
    one_error_line(code, *capfd.readouterr(), "does not match its cluster fingerprint")


def test_model_file_is_profiled_on_its_example_inputs(capfd):
    from autopar.cli.cmd_run import _build_and_profile

    path = str(FIXTURES / "tiny_mlp.py")
    assert main(["estimate", path, "--dp", "2", "--global-batch", "8", "--json"]) == 0
    doc = json.loads(capfd.readouterr().out)  # no --seq-len: example_inputs give 16 tokens
    assert doc["config"]["dp"] == 2 and doc["model"] == path and doc["seq_len"] == 16
    # The profile `autopar run` makes of the file, so a plan's fingerprint matches its run.
    assert doc["profile_fingerprint"] == _build_and_profile(path)[1].fingerprint()
    code = main(["estimate", path, "--global-batch", "8", "--seq-len", "32"])
    one_error_line(code, *capfd.readouterr(), "differs from the 16 tokens")


def test_hf_config_is_a_model(tmp_path, capfd):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
                                  "vocab_size": 256, "n_positions": 32}))
    assert main(["estimate", str(config), "--tp", "2", "--global-batch", "8", "--json"]) == 0
    doc = json.loads(capfd.readouterr().out)
    assert doc["seq_len"] == 32 and doc["config"]["tp"] == 2
    assert doc["tp_layout"], "an HF GPT-2 at tp=2 gets a tensor-parallel layout"


def test_hf_context_is_capped_as_profile_caps_it(tmp_path, capfd):
    """Without --seq-len, an HF config's long context is taken capped at 4096 tokens, as
    ``autopar.profile`` takes it, and the report says the sequence length it planned for."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
                                  "vocab_size": 256, "n_positions": 32768}))
    assert main(["estimate", str(config), "--global-batch", "8", "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["seq_len"] == 4096
    assert main(["estimate", str(config), "--global-batch", "8", "--seq-len", "8192"]) == 0
    assert "global batch 8 sequences of 8,192 tokens = dp 1" in capfd.readouterr().out


def test_presets_lists_the_zoo_and_the_clusters(capfd):
    assert main(["presets"]) == 0
    out = capfd.readouterr().out
    for name in ("gpt3-175b", "llama3-405b", "llama2-70b", "a100-80g", "h100", "h200",
                 "v100-32g", "cpu"):
        assert name in out, name
