"""Issue 13's bad inputs: each exits 2 with one ``autopar: error:`` line, no traceback, no file
left behind, quickly. In process through ``autopar.cli.main``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.config import ParallelConfig
from autopar.cost_model.hardware import Cluster
from autopar.search.space import divisors
from tests.helpers import one_error_line

TINY = "gpt:layers=4,hidden=64,heads=4,vocab=256,seq_len=32"
CLUSTER = Path(__file__).parents[1] / "fixtures" / "clusters" / "a100_2nodes.yaml"
PLAN = ["plan", TINY, "--gpus", "1", "--global-batch", "8"]
FIXTURE_MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
MOE = "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,seq_len=32,experts=4"


def _fails(capfd, argv, needle, *, seconds=10.0):
    start = time.monotonic()
    code = main(argv)
    assert time.monotonic() - start < seconds
    one_error_line(code, *capfd.readouterr(), needle)


@pytest.mark.parametrize(("argv", "needle"), [
    (["plan", TINY, "--gpus", "8000000000", "--global-batch", "8"], "--gpus: must be from 1"),
    (["plan", TINY, "--gpus", "8", "--global-batch", str(2**62)], "--global-batch: must be"),
    ([*PLAN, "--seq-len", "-4"], "--seq-len: must be from 1"),
    ([*PLAN, "--gpu-memory", "inf"], "not a finite number"),
    (["plan", TINY, "--gpus", "1", "--global-batch", "0"], "--global-batch: must be from 1"),
    (["sweep", TINY, "--gpus", "8", "--tokens", "nan"], "--tokens: 'nan' is not a finite"),
    (["sweep", TINY, "--gpus", "8", "--tokens", "1e9", "--gpu", ","], "names no GPU preset"),
    (["sweep", TINY, "--gpus", "8", "--tokens", "1e9", "--gpu", "a100-80g",
      "--price-per-gpu-hour", "a100-80g=2,a100-80g=3"], "prices a100-80g more than once"),
    (["plan", TINY, "--gpus", "x"], "see `autopar plan --help`"),
    (["run", "nothing.json"], "see `autopar run --help`"),
    # run declares the split flags as estimate does (cli/split_args.py): --dp 0 ran as dp 1.
    (["run", TINY, "--steps", "1", "--global-batch", "4", "--dp", "0"], "--dp: must be from 1"),
    (["run", TINY, "--steps", "1", "--global-batch", "4", "--micro-batch", "0"],
     "--micro-batch: must be from 1"),
    (["run", TINY, "--steps", "1", "--global-batch", "4", "--schedule", "x"],
     "--schedule: invalid choice"),
    (["plan", "llama:layers=2,hidden=64,heads=4,vocab=256,seq_len=32,rope_theta=nan",
      "--gpus", "1", "--global-batch", "2"], "rope_theta='nan' is not a valid value"),
    (["estimate", TINY, "--dp", "4", "--ep", "2", "--global-batch", "8", "--gpu", "h100",
      "--framework", "megatron-lm"], "needs a mixture-of-experts model"),
    (["estimate", f"{MOE},top_k=2", "--dp", "4", "--ep", "3", "--global-batch", "8"],
     "does not divide dp"),
    (["estimate", f"{MOE},top_k=5", "--dp", "4", "--global-batch", "8"], "top_k must be"),
    # a typo's size fails at once instead of building a model for hours
    (["estimate", "gpt:layers=99999999999999999999,hidden=64,heads=4,vocab=256,seq_len=32",
      "--gpus", "1", "--global-batch", "4"], "layers must be at most 10,000"),
    # --force with no file to overwrite had been ignored without a word
    ([*PLAN, "--force"], "--force overwrites the file --out or --plot names"),
    (["verify", "plan.json", "--force"], "--force overwrites the file --out or --plot names"),
    # a forced fp8 on a part without fp8 tensor cores: said once, not a division by zero
    ([*PLAN, "--dtype", "fp8", "--framework", "torchtitan"], "dtype fp8 needs fp8 tensor cores"),
    (["sweep", TINY, "--gpus", "8", "--tokens", "1e9", "--price-per-gpu-hour", "nan"],
     "a price must be a number from 0 to 1,000,000"),
    (["sweep", TINY, "--gpus", "8", "--tokens", "1e9", "--price-per-gpu-hour",
      "a100-80g=-1"], "a price must be a number from 0 to 1,000,000"),
    # a finite price whose cost overflowed to Infinity in the JSON
    (["sweep", TINY, "--gpus", "8", "--tokens", "1e15", "--price-per-gpu-hour", "1e308"],
     "a price must be a number from 0 to 1,000,000"),
    (["calibrate", "--nproc", "1000000"], "--nproc: must be from 1 to 64"),
    (["calibrate", "--nproc", "0"], "--nproc: must be from 1 to 64"),
    ([*PLAN, "--gpu-memory", "1e-308"], "--gpu-memory: must be at least 0.001 and at most"),
    # the framework that does not train the dtype is named, not the global batch
    (["plan", TINY, "--gpus", "4", "--gpu", "h100", "--global-batch", "8", "--dtype", "fp8"],
     "autopar trains in bf16, fp16, fp32, not fp8"),
    (["export", "plan.json", "--to", "slurm", "--steps", "0"], "--steps: must be from 1"),
    (["export", "plan.json", "--to", "megatron", "--steps", "5"], "--steps goes with --to slurm"),
    # a typo in the digits had started an endless run or verify
    (["run", TINY, "--global-batch", "4", "--steps", "1e20"], "--steps: must be from 1 to"),
    ([*PLAN, "--out", ""], "an output path is empty; give a file name"),
    # a plan records its model: one it could not read back was written
    (["plan", "tab\tdir/c.json", "--gpus", "2", "--global-batch", "4"],
     "holds a non-printable character"),
    (["run", "tab\tdir/c.json", "--global-batch", "4", "--steps", "1"],
     "holds a non-printable character"),
    (["verify", "plan.json", "--refit", "--out", "no/such/dir/c.yaml"],
     "cannot write no/such/dir/c.yaml: directory"),
    (["verify", "plan.json", "--steps", "100000000000000000000"], "--steps: must be from 1 to"),
    (["run", TINY, "--global-batch", "4", "--steps", "1", "--max-restarts", "1e9"],
     "--max-restarts: must be from 0 to 1000"),
    ([*PLAN, "--build-timeout", "0.0001"], "--build-timeout: must be at least 0.001"),
    (["sweep", TINY, "--gpus", "8", "--tokens", "1e9", "--gpu-memory", "1e-308"],
     "--gpu-memory: must be at least 0.001"),
    # a bound on what --no-cp turns off had been ignored without a word
    ([*PLAN, "--no-cp", "--max-cp", "4"], "--max-cp shapes the context parallelism --no-cp"),
    # torchrun retried an endpoint it cannot parse without end; node counts had no bounds
    (["run", TINY, "--global-batch", "4", "--steps", "1", "--rdzv-endpoint", "garbage"],
     "is not HOST:PORT"),
    (["run", TINY, "--global-batch", "4", "--steps", "1", "--nproc-per-node", "-2"],
     "--nproc-per-node: must be from 1"),
    # refused before any worker starts (the workers crashed with a traceback): nanoGPT
    # verbatim keeps the last position's logits only; pipeline stages take token ids
    (["run", str(FIXTURE_MODELS / "tiny_nanogpt.py"), "--global-batch", "4", "--steps", "1"],
     "returned logits for 1 of"),
    # and planned for autopar's runtime, which would refuse to run it (other frameworks: a
    # warning, tests/unit/test_graph_misleading_inputs.py)
    (["plan", str(FIXTURE_MODELS / "tiny_nanogpt.py"), "--gpus", "4", "--global-batch", "16"],
     "returned logits for 1 of"),
    (["estimate", str(FIXTURE_MODELS / "tiny_nanogpt.py"), "--dp", "4", "--global-batch", "16"],
     "returned logits for 1 of"),
    (["run", str(FIXTURE_MODELS / "tiny_nanogpt_targets.py"), "--global-batch", "4",
      "--steps", "1", "--pp", "2"], "pipeline stages take token ids"),
])
def test_bad_arguments(capfd, argv, needle):
    _fails(capfd, argv, needle)


def test_cluster_yaml_bounds(tmp_path, capfd):
    text = CLUSTER.read_text()
    huge = tmp_path / "huge.yaml"
    huge.write_text(text.replace("nodes: 2", "nodes: 1e100"))
    _fails(capfd, ["plan", TINY, "--cluster", str(huge), "--global-batch", "8"], "nodes")
    slow = tmp_path / "slow.yaml"
    slow.write_text(text.replace("peak_bf16_flops: 312000000000000.0", "peak_bf16_flops: 1e-300"))
    _fails(capfd, ["plan", TINY, "--cluster", str(slow), "--global-batch", "8"], "peak_bf16")


def test_a_model_path_that_is_a_directory_says_so(tmp_path, capfd):
    for name in ("m.py", "config.json"):
        (tmp_path / name).mkdir()
        _fails(capfd, ["plan", str(tmp_path / name), "--gpus", "2", "--global-batch", "8"],
               "is a directory, not a file")


def test_same_out_and_plot_refused(tmp_path, capfd):
    path = tmp_path / "x.png"
    _fails(capfd, [*PLAN, "--out", str(path), "--plot", str(path)], "both name")
    assert not path.exists()


MODELS = {
    "exit": ("import sys\ndef build_model():\n    sys.exit(0)\n", "raised SystemExit"),
    "interrupt": ("def build_model():\n    raise KeyboardInterrupt\n", "KeyboardInterrupt"),
    "not-module": ("def build_model():\n    return 3\n", "not a torch.nn.Module"),
    "endless": ("def build_model():\n    while True:\n        pass\n", "took longer than 1 s"),
    # any BaseException: GeneratorExit, a class of the file's own (a test framework's skip)
    "generator-exit": ("def build_model():\n    raise GeneratorExit('gen')\n",
                       "raised GeneratorExit"),
    "own-base": ("class Stop(BaseException):\n    pass\n"
                 "def build_model():\n    raise Stop\n", "raised Stop"),
    # nothing to train: the message had blamed value-dependent control flow
    "frozen": ("from torch import nn\ndef build_model():\n"
               "    return nn.Linear(4, 4).requires_grad_(False)\n",
               "Linear has no trainable parameters"),
    "import-time": ("raise GeneratorExit\ndef build_model():\n    pass\n",
                    "raised GeneratorExit while loading"),
}


@pytest.mark.parametrize("case", sorted(MODELS))
def test_model_file_code_cannot_end_the_command(tmp_path, capfd, case):
    source, needle = MODELS[case]
    path = tmp_path / "m.py"
    path.write_text(source + "def example_inputs(b):\n    return None\n")
    out = tmp_path / "p.json"
    _fails(capfd, ["plan", str(path), "--gpus", "1", "--global-batch", "8", "--seq-len", "8",
                   "--json", "--out", str(out), "--build-timeout", "1"], needle)
    assert not out.exists()


def test_time_budget_bounds_model_building(tmp_path, capfd):
    path = tmp_path / "m.py"
    path.write_text(MODELS["endless"][0] + "def example_inputs(b):\n    return None\n")
    _fails(capfd, ["plan", str(path), "--gpus", "1", "--global-batch", "8", "--seq-len", "8",
                   "--time-budget", "1"], "took longer than")


@pytest.fixture(scope="module")
def plan_doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "p.json"
    assert main(["plan", TINY, "--gpus", "4", "--global-batch", "8", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _mutate(doc, path, value):
    doc = json.loads(json.dumps(doc))
    *keys, last = path
    target = doc
    for key in keys:
        target = target[key]
    target[last] = value
    return doc


@pytest.mark.parametrize(("path", "value", "needle"), [
    (("estimate", "step_time_s"), "fast", "must be a number"),
    (("estimate", "tokens_per_s"), float("inf"), "Infinity"),
    (("estimate", "memory_per_gpu_bytes"), float("nan"), "NaN"),
    (("config", "dp"), 32, "= 32 does not equal the cluster"),
])
@pytest.mark.parametrize("command", ["show", "explain", "export"])
def test_bad_plans_refused(tmp_path, capfd, plan_doc, path, value, needle, command):
    doc = _mutate(plan_doc, path, value)
    if path == ("config", "dp"):
        doc["config"].update(global_batch=64, micro_batch=2)
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(doc))
    extra = ["--to", "torchtitan"] if command == "export" else []
    _fails(capfd, [command, str(file), *extra], needle)


# Fields of the wrong type: each one line naming the field, not an internal error in a report or
# an exporter (a one-element layer range, a float node count that would skip the world-size
# check, a string where show prints a number, a model name that is not a string).
@pytest.mark.parametrize(("path", "value", "needle"), [
    (("schema_version",), "1", "schema_version must be a whole number"),
    (("schema_version",), 1.5, "schema_version must be a whole number"),
    (("schema_version",), True, "schema_version must be a whole number"),
    (("stages", 0, "layers"), [0], "stages[0].layers must be [first, last]"),
    (("stages", 0, "layers"), ["0", "3"], "stages[0].layers[0] must be a whole number"),
    (("stages", 0, "layer_names"), [0, 1, 2, 3, 4, 5], "layer_names[0] must be a string"),
    (("model",), 7, "plan model must be a string"),
    (("model",), "gpt\n\x1b[2J", "plan model must be one line of printable text"),
    (("cluster", "nodes"), 1.0, "cluster.nodes must be a whole number"),
    (("search", "mip_gap"), "x", "search.mip_gap must be a number"),
    (("search", "optimal"), "yes", "search.optimal must be true or false"),
    (("search", "speed"), 1, "unknown field 'speed'"),
    (("seq_len",), "64", "seq_len must be a whole number"),
    (("seq_len",), 10 ** 4000, "seq_len must be from 0 to 16,777,216"),  # an export's overflow
    (("model",), "m" * 5_000_000, "at most 4,096 characters"),  # a plot of it hung
    # Inside the estimate: show divided, formatted or indexed these (internal errors, "inf%",
    # a negative compute share, an interval from 9 s to 1 s).
    (("estimate", "time_breakdown", "compute_s"), None, "compute_s must be a number"),
    (("estimate", "time_breakdown", "compute_s"), -1, "compute_s must be finite and >= 0"),
    (("estimate", "time_breakdown", "speed_s"), 1, "unknown field(s) speed_s"),
    (("estimate", "host_memory_per_gpu_bytes"), "x", "host_memory_per_gpu_bytes must be a"),
    (("estimate", "stages", 0, "time_per_microbatch_s"), "x", "time_per_microbatch_s must be"),
    (("estimate", "stages", 0, "rank"), 7, "stages[0].rank must be from 0 to"),
    (("estimate", "step_time_interval_s"), [1], "step_time_interval_s must be [low, high]"),
    (("estimate", "step_time_interval_s"), [9, 1], "must have low <= high"),
    (("estimate", "mfu"), 1e308, "estimate.mfu must be at most 2"),
    (("tp_layout",), [1, 2], "tp_layout must be an object"),
])
@pytest.mark.parametrize("command", ["show", "export"])
def test_mistyped_plan_fields_refused(tmp_path, capfd, plan_doc, path, value, needle, command):
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(_mutate(plan_doc, path, value)))
    extra = ["--to", "slurm"] if command == "export" else []
    _fails(capfd, [command, str(file), *extra], needle)


def _short(doc):  # the last stage stops before the head
    stage = doc["stages"][-1]
    stage.update(layers=[stage["layers"][0], stage["layers"][1] - 1],
                 layer_names=stage["layer_names"][:-1], recompute=stage["recompute"][:-1])
    return doc


def _swapped(doc):  # block names out of order
    names = doc["stages"][0]["layer_names"]
    names[1], names[2] = names[2], names[1]
    return doc


def _renumbered(doc):  # layers.N -> layers.1N: in order, but not the model's
    for stage in doc["stages"]:
        stage["layer_names"] = [n.replace("layers.", "layers.1") for n in stage["layer_names"]]
    return doc


@pytest.mark.parametrize(("edit", "needle"), [
    (_short, "do not run from the embedding to the head"),
    (_swapped, "blocks are not in order"),
    (_renumbered, "blocks are not layers.0 .. layers.3 (found layers.10 .. layers.13)"),
    (lambda doc: doc["config"].update(dtype="fp8") or doc,
     "the plan's cluster cannot train it: dtype fp8 needs fp8 tensor cores"),
])
@pytest.mark.parametrize("command", ["show", "export"])
def test_inconsistent_plans_refused(tmp_path, capfd, plan_doc, edit, needle, command):
    """A plan cut short, renumbered or in a dtype its device lacks: show and every export took
    it (the torchtitan export wrote model parts without the head; show divided by zero)."""
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(edit(json.loads(json.dumps(plan_doc)))))
    extra = ["--to", "torchtitan"] if command == "export" else []
    _fails(capfd, [command, str(file), *extra], needle)


def test_export_refuses_a_seq_len_its_estimate_contradicts(tmp_path, capfd, plan_doc):
    """An edited seq_len was written as the run's --seq-length (Megatron-LM) and seq_len
    (torchtitan); the estimate's own identity gives the profiled one."""
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(_mutate(plan_doc, ("seq_len",), 2**20)))
    for tool in ("megatron", "torchtitan"):
        _fails(capfd, ["export", str(file), "--to", tool], "contradicts its estimate")


def test_export_of_a_plan_without_seq_len_checks_the_estimate(tmp_path, capfd, plan_doc):
    """Without its own seq_len a plan's sequence length comes from its estimate, which must give
    a whole number of tokens (1e308 s a step overflowed the exporter)."""
    doc = _mutate(_mutate(plan_doc, ("seq_len",), 0), ("estimate", "step_time_s"), 1e308)
    doc = _mutate(doc, ("estimate", "step_time_interval_s"), [1e308, 1e308])
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(doc))
    _fails(capfd, ["export", str(file), "--to", "torchtitan"], "tokens per sequence")


def test_deep_json_refused(tmp_path, capfd):
    file = tmp_path / "deep.json"
    file.write_text('{"schema_version": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _fails(capfd, ["show", str(file)], "nested too deeply")
    file.write_text('{"schema_version": 1, "seq_len": ' + "9" * 5000 + "}")
    _fails(capfd, ["show", str(file)], "integer of thousands of digits")
    # The same through every reader of JSON: run's plan, an HF config, verify (which also
    # named no file for a binary one).
    deep = "[" * 100_000 + "]" * 100_000
    file.write_text('{"schema_version": 1, "x": ' + deep + "}")
    _fails(capfd, ["run", str(file), "--steps", "1"], f"{file} is nested too deeply")
    config = tmp_path / "config.json"
    for value, needle in ((deep, "is nested too deeply"),
                          ("9" * 5000, "holds an integer of thousands of digits")):
        config.write_text('{"model_type": "llama", "x": ' + value + "}")
        _fails(capfd, ["estimate", str(config), "--gpus", "1", "--global-batch", "2"],
               f"{config} {needle}; it is not an HF config")
    file.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    for command in (["verify", str(file)], ["show", str(file)]):
        _fails(capfd, command, f"plan file {file} is not UTF-8 text")


def test_api_types():
    with pytest.raises(ValueError, match="zero"):
        ParallelConfig(global_batch=8, zero=3.0)
    with pytest.raises(TypeError, match="gpu_memory_gb"):
        Cluster.preset("h100", gpu_memory_gb=True)
    with pytest.raises(ValueError, match="global_batch"):
        ParallelConfig(global_batch=2**62)


def test_divisors_are_fast_and_exact():
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 300))
    start = time.monotonic()
    assert divisors(2**24)[-1] == 2**24
    assert time.monotonic() - start < 0.5


def test_closed_stdout_still_writes_the_plan(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "p.json"
    cmd = f"{sys.executable} -m autopar.cli plan '{TINY}' --gpus 1 --global-batch 8 --out {out}"
    result = subprocess.run(f"set -o pipefail; {cmd} | head -c 1 >/dev/null", shell=True,
                            executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert json.loads(out.read_text())["schema_version"] >= 1


def test_a_yaml_alias_bomb_is_named_in_a_bounded_line(tmp_path, capfd):
    """Nested aliases share their items in memory; the error names the field without
    expanding them (a full repr of nine levels would fill the machine's memory)."""
    levels = ["&a [" + ",".join(["lol"] * 9) + "]"]
    levels += [f"&{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(8)]
    bomb = tmp_path / "bomb.yaml"
    text = CLUSTER.read_text()
    assert text.startswith("name: a100-80g\n")
    bomb.write_text(text.replace("name: a100-80g", "name: [" + ", ".join(levels) + "]", 1))
    start = time.monotonic()
    code = main(["plan", TINY, "--cluster", str(bomb), "--global-batch", "8"])
    assert time.monotonic() - start < 10
    _out, err = capfd.readouterr()
    assert code == 2 and len(err) < 2000, err[:300]
    assert err.startswith("autopar: error: cluster field name must be a string"), err[:300]


def test_a_failed_write_keeps_what_the_user_had(tmp_path, capfd):
    """--out and --plot are written together or not at all: a directory in --plot's way fails
    before the search, and a write that fails leaves the old file, not a half-written one."""
    from autopar.cli.common import write_outputs
    from autopar.errors import AutoparError

    keep = tmp_path / "keep.json"
    keep.write_text('{"old": 1}')
    (tmp_path / "adir.png").mkdir()
    _fails(capfd, [*PLAN, "--out", str(keep), "--plot", str(tmp_path / "adir.png"), "--force"],
           "is a directory")
    assert keep.read_text() == '{"old": 1}'
    with pytest.raises(AutoparError, match="cannot write"):
        write_outputs([(str(keep), "new"), (str(tmp_path / "missing" / "p.png"), b"x")],
                      force=True)
    assert keep.read_text() == '{"old": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir.png", "keep.json"]
    write_outputs([(str(keep), "new")], force=True)
    assert keep.read_text() == "new"


_MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
            "vocab_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2,
            "bos_token_id": None, "eos_token_id": None}


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("hidden_size", 0, "hidden_size is 0; it must be from 1 to 1,048,576"),
    ("vocab_size", -5, "vocab_size is -5"),
    ("num_hidden_layers", 0, "num_hidden_layers is 0"),
    ("num_local_experts", -1, "num_local_experts is -1; it must be at least 0"),
    ("head_dim", 0, "head_dim is 0"),  # a ZeroDivisionError in the rotary embedding
    ("max_position_embeddings", -1, "max_position_embeddings is -1"),  # a negative tensor size
    ("num_key_value_heads", 3, "num_key_value_heads (3) must divide num_attention_heads (4)"),
    ("num_experts_per_tok", 8, "num_experts_per_tok (8) is more than its 4 experts"),
])
def test_hf_config_sizes_checked(tmp_path, capfd, field, value, needle):
    """transformers checks none of these: a 0 planned a model without blocks, or failed inside
    the build as an internal error."""
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**_MIXTRAL, field: value}))
    _fails(capfd, ["plan", str(file), "--gpus", "4", "--global-batch", "8", "--seq-len", "64"],
           needle, seconds=60)


def test_sequence_beyond_learned_positions_refused(tmp_path, capfd):
    """A learned position table bounds the sequence (on meta nothing indexes it; on a device
    the run would fail): the zoo GPT's and GPT-2's alike; 128 of 128 positions is fine."""
    _fails(capfd, ["plan", TINY, "--gpus", "1", "--global-batch", "8", "--seq-len", "64"],
           "beyond the 32 positions of the model's learned position embedding (pos_embeddings)")
    file = tmp_path / "config.json"
    file.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
                                "vocab_size": 256, "n_positions": 128, "bos_token_id": 0,
                                "eos_token_id": 0}))
    _fails(capfd, ["plan", str(file), "--gpus", "1", "--global-batch", "8", "--seq-len", "256"],
           "at most 128", seconds=60)
    assert main(["plan", str(file), "--gpus", "1", "--global-batch", "8", "--seq-len", "128"]) == 0


@pytest.mark.parametrize(("section", "field", "value", "needle"), [
    ("device", "peak_bf16_flops", 1e308, "at most 1e+18 per second"),
    ("intra_node", "latency_s", 1e308, "at most 60 s"),
    (None, "all_reduce_time_factor", 1e308, "at most 1000"),
    ("device", "matmul_half_flops", 1e300, "at most 1e+18 FLOPs"),
])
def test_cluster_values_beyond_any_hardware_refused(tmp_path, capfd, section, field, value,
                                                    needle):
    """Finite but absurd values overflowed the cost model into infinities and NaNs that the
    search could not order (an internal error in the ILP); each is now one line."""
    import yaml

    data = Cluster.preset("h100", nodes=1).to_dict()
    (data[section] if section else data)[field] = value
    file = tmp_path / "c.yaml"
    file.write_text(yaml.safe_dump(data))
    _fails(capfd, ["plan", TINY, "--cluster", str(file), "--global-batch", "8"],
           f"{field} is {value:g}, beyond any hardware ({needle}")


def test_world_size_and_missing_gpu_errors_name_the_fix(capfd):
    _fails(capfd, ["estimate", TINY, "--dp", "3", "--global-batch", "6", "--gpus", "8"],
           "choose degrees whose product is 8, or a cluster of 3 GPUs (--gpus 3)")
    import torch

    if not torch.cuda.is_available():
        _fails(capfd, ["calibrate", "--device", "cuda"], "torch sees no GPU here")


def test_explain_bounds_model_building(tmp_path, capfd, plan_doc):
    """explain rebuilds the plan's model: a model file that never returns stops at
    --build-timeout, as plan and estimate stop."""
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps(plan_doc))
    path = tmp_path / "m.py"
    path.write_text(MODELS["endless"][0] + "def example_inputs(b):\n    return None\n")
    _fails(capfd, ["explain", str(plan), "--model", str(path), "--build-timeout", "1"],
           "took longer than 1 s")


def test_cluster_factor_below_any_hardware_and_deep_yaml_refused(tmp_path, capfd):
    import yaml

    data = Cluster.preset("h100", nodes=1).to_dict()
    data["device"]["matmul_efficiency_max"] = 5e-324  # divided the cost model by zero
    file = tmp_path / "c.yaml"
    file.write_text(yaml.safe_dump(data))
    _fails(capfd, ["plan", TINY, "--cluster", str(file), "--global-batch", "8"],
           "below any hardware (at least 0.001)")
    file.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    _fails(capfd, ["plan", TINY, "--cluster", str(file), "--global-batch", "8"],
           "nested too deeply")


def test_run_refuses_what_the_runtime_cannot_run(tmp_path, capfd):
    """An fp8 plan (made for torchtitan) reached the workers and failed there with a KeyError;
    the runtime's own record says what it runs, before any process starts."""
    plan = tmp_path / "p.json"
    assert main(["estimate", TINY, "--dp", "4", "--global-batch", "8", "--gpu", "h100",
                 "--dtype", "fp8", "--framework", "torchtitan", "--out", str(plan)]) == 0
    capfd.readouterr()
    _fails(capfd, ["run", str(plan), "--steps", "1", "--dry-run"],
           "autopar's runtime cannot run this plan: autopar trains in bf16, fp16, fp32, not fp8")


@pytest.mark.parametrize(("content", "needle"), [
    (b"\xff\xfe\xaf\x00 not text", "is not text (UTF-8 YAML)"),
    (b"nodes: " + b"9" * 5000 + b"\n", "holds an integer of thousands of digits"),
    (None, "cluster field device must be a mapping"),  # was "device." with a stray dot
])
def test_unreadable_cluster_files_named(tmp_path, capfd, content, needle):
    import yaml

    file = tmp_path / "c.yaml"
    if content is None:
        data = {**Cluster.preset("h100", nodes=1).to_dict(), "device": 3}
        content = yaml.safe_dump(data).encode()
    file.write_bytes(content)
    _fails(capfd, ["plan", TINY, "--cluster", str(file), "--global-batch", "8"], needle)


def test_directories_given_as_files_named(tmp_path, capfd):
    _fails(capfd, ["plan", TINY, "--cluster", str(tmp_path), "--global-batch", "8"],
           "is a directory; give a cluster YAML file")
    _fails(capfd, ["show", str(tmp_path)], "is a directory; give a plan JSON file")


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda text: text + "nodes: 2\n", "the key 'nodes' is given twice"),
    (lambda text: text.replace("nodes: 1", "nodes: 1:00"), "'1:00' is a base-60 number"),
    (lambda text: text.replace("nodes: 1", "nodes: 010"), "'010' is octal (8) in YAML 1.1"),
])
def test_yaml_typos_are_not_read_as_data(tmp_path, capfd, edit, needle):
    """YAML 1.1 keeps the last of two equal keys, reads 1:00 as 60 (sexagesimal) and 010 as 8
    (octal): a cluster file is read strictly instead."""
    import yaml

    file = tmp_path / "c.yaml"
    text = yaml.safe_dump(Cluster.preset("h100", nodes=1).to_dict(), sort_keys=False)
    assert "nodes: 1\n" in text
    file.write_text(edit(text))
    _fails(capfd, ["plan", TINY, "--cluster", str(file), "--global-batch", "8"], needle)


@pytest.mark.parametrize("name", ["", "h100\n\x1b[31mred", "x" * 101])
def test_cluster_names_are_one_printable_line(tmp_path, capfd, name):
    """A cluster's name heads every report: an empty, multi-line or terminal-control name was
    printed as given."""
    import yaml

    data = Cluster.preset("h100", nodes=1).to_dict()
    data["name"] = name
    file = tmp_path / "c.yaml"
    file.write_text(yaml.safe_dump(data))
    _fails(capfd, ["plan", TINY, "--cluster", str(file), "--global-batch", "8"],
           "must be one line of 1 to 100 printable characters")


def test_dense_variants_of_moe_families_and_yaml_merge_keys_still_read(tmp_path):
    """What the strict readers must not refuse: 0 experts is a dense variant (Granite 4.0 dense
    configs say so), and a cluster file may inherit a link with a YAML merge key."""
    import yaml

    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "granitemoehybrid", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "shared_intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 0,
        "num_experts_per_tok": 0, "layer_types": ["attention", "attention"],
        "max_position_embeddings": 128, "position_embedding_type": "rope",
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}))
    assert main(["plan", str(config), "--gpus", "8", "--gpu", "h100", "--global-batch",
                 "16"]) == 0
    text = yaml.safe_dump(Cluster.preset("h100", nodes=2).to_dict(), sort_keys=False)
    text = text.replace("intra_node:", "intra_node: &link", 1)
    head, _, tail = text.partition("inter_node:\n")
    tail = "\n".join(line for line in tail.splitlines() if not line.startswith("  "))
    cluster = tmp_path / "c.yaml"
    cluster.write_text(head + "inter_node:\n  <<: *link\n  bandwidth_bytes_per_s: 5.0e+10\n"
                       + tail + "\n")
    assert main(["plan", TINY, "--cluster", str(cluster), "--global-batch", "16"]) == 0


def test_outputs_write_through_links_and_refuse_devices(tmp_path, capfd):
    """--force replaced whatever the path was (a device node became a regular file, a symbolic
    link a file beside its target, a private file a 644 one), and a dangling link was
    replaced without --force. Now a device, pipe or socket is refused, a link is written
    through, the replaced file keeps its permissions, and a dangling link needs --force."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _fails(capfd, [*PLAN, "--out", str(fifo), "--force"], "is not a regular file")
    assert fifo.is_fifo()
    real = tmp_path / "real.json"
    real.write_text("old")
    real.chmod(0o600)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert main([*PLAN, "--out", str(link), "--force"]) == 0
    capfd.readouterr()
    assert link.is_symlink() and json.loads(real.read_text())["config"]["dp"] == 1
    assert real.stat().st_mode & 0o777 == 0o600
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "missing.json")
    _fails(capfd, [*PLAN, "--out", str(dangling)], "already exists; pass --force")


def test_calibrate_refuses_its_output_before_measuring(tmp_path, capfd):
    """A directory as --out failed only after the measurements, with no fix named."""
    _fails(capfd, ["calibrate", "--quick", "--nproc", "1", "--out", str(tmp_path), "--force"],
           "is a directory; give a file name", seconds=5.0)


_LLAMA_HF = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
             "vocab_size": 256, "max_position_embeddings": 64}


@pytest.mark.parametrize(("config", "needle"), [
    # transformers raised these from inside its build: internal errors before.
    ({**_LLAMA_HF, "attn_implementation": "flash_attention_2"}, "ImportError: FlashAttention2"),
    ({**_LLAMA_HF, "model_type": "qwen3_moe", "moe_intermediate_size": 32, "num_experts": 4,
      "num_experts_per_tok": 2, "decoder_sparse_step": 0}, "ZeroDivisionError"),
    # accepted before and reported as "top-0".
    ({**_LLAMA_HF, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 0},
     "num_experts_per_tok is 0"),
])
def test_hf_configs_transformers_cannot_build(tmp_path, capfd, config, needle):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    _fails(capfd, ["estimate", str(path), "--global-batch", "4", "--seq-len", "16"], needle,
           seconds=60.0)


def test_more_inputs_named_before_any_work(tmp_path, capfd):
    """A seed beyond the 64-bit generator's range crashed every worker; a plot named .svg got
    PNG bytes; /dev/null was said not to exist; an HF config without a context length had no
    way to run (run had no --seq-len), and explain printed splits estimate refuses."""
    base = ["run", TINY, "--global-batch", "4", "--steps", "1"]
    _fails(capfd, [*base, "--seed", str(2**64)], "--seed: must be from 0")
    _fails(capfd, [*PLAN, "--plot", str(tmp_path / "p.svg")], "give a path ending in .png")
    _fails(capfd, ["show", "/dev/null"], "is not a regular file")
    # A dry run checks the run's checkpoint flags too (it reported OK for them).
    _fails(capfd, [*base, "--dry-run", "--resume"], "--resume needs --checkpoint-dir")
    assert main([*base, "--seq-len", "16", "--dry-run"]) == 0
    capfd.readouterr()
    plan = tmp_path / "p.json"
    assert main([*PLAN, "--out", str(plan)]) == 0
    capfd.readouterr()
    _fails(capfd, ["run", str(plan), "--steps", "1", "--seq-len", "16", "--dry-run"],
           "drop --seq-len")
    doc = json.loads(plan.read_text())
    doc["config"]["sequence_parallel"] = True
    doc["profile_fingerprint"] = doc["cluster_fingerprint"] = ""
    plan.write_text(json.dumps(doc))
    _fails(capfd, ["explain", str(plan)], "sequence_parallel needs tp > 1", seconds=60.0)


def test_a_model_files_thread_and_exit_hook_neither_hold_nor_corrupt_the_command(tmp_path):
    """A model file that starts a non-daemon thread kept `autopar plan` alive after it had
    printed the plan, and its atexit print followed the JSON document on stdout."""
    import subprocess
    import sys

    model = tmp_path / "threads.py"
    model.write_text(
        "import atexit, threading, time\nimport torch\nfrom torch import nn\n"
        "threading.Thread(target=lambda: time.sleep(600)).start()\n"
        "atexit.register(lambda: print('left behind'))\n"
        "def build_model():\n    return nn.Sequential(nn.Linear(8, 8), nn.ReLU())\n"
        "def example_inputs(batch_size):\n    return torch.randn(batch_size, 8)\n")
    argv = ["plan", str(model), "--gpus", "2", "--gpu", "cpu", "--global-batch", "4", "--json"]
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from autopar.cli import console; "
         f"sys.argv = ['autopar', *{argv!r}]; console()"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["config"]["dp"] >= 1  # one document, nothing after it


def test_a_model_file_ignoring_the_alarm_still_ends_at_the_build_timeout(tmp_path):
    """A model file that ignores SIGALRM and loops in build_model ran for 13+ minutes past
    --build-timeout 15; the command now ends a few seconds after the limit with one line."""
    import subprocess
    import sys

    model = tmp_path / "stubborn.py"
    model.write_text(
        "import signal\nimport torch\nfrom torch import nn\n"
        "def build_model():\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "    while True:\n        pass\n"
        "def example_inputs(batch_size):\n    return torch.randn(batch_size, 8)\n")
    argv = ["plan", str(model), "--gpus", "2", "--gpu", "cpu", "--global-batch", "4",
            "--build-timeout", "1"]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from autopar.cli import console; "
         f"sys.argv = ['autopar', *{argv!r}]; console()"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert time.monotonic() - start < 60
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("autopar: error:") and "held off the time limit" in lines[-1]


def test_a_plans_moe_record_and_report_words_are_checked(tmp_path, capfd):
    """The plan's ``moe`` object was read unchecked (a string capacity factor ended show and
    export in internal errors; top_k 99 of 4 experts was exported), and the estimate's words
    reached the terminal with their control characters."""
    model = "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,seq_len=32,experts=4,top_k=2"
    out = tmp_path / "m.json"
    assert main(["estimate", model, "--gpus", "4", "--dp", "2", "--ep", "2", "--pp", "2",
                 "--global-batch", "8", "--out", str(out)]) == 0
    capfd.readouterr()
    doc = json.loads(out.read_text())
    for path, value, needle in (
            (("moe", "capacity_factor"), "x", "moe.capacity_factor must be a number"),
            (("moe", "capacity_factor"), 1e308, "moe.capacity_factor must be below 1e+06"),
            (("moe", "experts"), "4", "moe.experts must be a whole number"),
            (("moe", "top_k"), 99, "moe.top_k must be from 0 to 4"),
            (("moe", "shared_experts"), -1, "moe.shared_experts must be at least 0"),
            (("moe", "router_imbalance"), 0.5, "moe.router_imbalance must be 0 (unknown)"),
            (("moe", "module"), "moe\n", "moe.module must be one line"),
            (("estimate", "binding"), "x\n\x1b[31mred", "estimate.binding must be one line")):
        file = tmp_path / "bad.json"
        file.write_text(json.dumps(_mutate(doc, path, value)))
        for command in (["show", str(file)], ["export", str(file), "--to", "megatron"]):
            _fails(capfd, command, needle)


def test_a_model_files_loss_is_checked_before_launch(tmp_path, capfd):
    """A loss_fn returning no tensor crashed every worker with a traceback; it is run once on
    the model's meta output first."""
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.emb = nn.Embedding(64, 16)\n"
        "        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])\n"
        "        self.head = nn.Linear(16, 64)\n"
        "    def forward(self, x):\n        h = self.emb(x)\n"
        "        for layer in self.layers:\n            h = layer(h)\n"
        "        return self.head(h)\n"
        "def build_model():\n    return M()\n"
        "def loss_fn(out, batch):\n    return 'oops'\n"
        "def example_inputs(b):\n    return torch.zeros(b, 8, dtype=torch.long)\n")
    _fails(capfd, ["run", str(path), "--global-batch", "2", "--steps", "1"],
           "loss_fn returned a str, not a scalar tensor", seconds=60.0)


def test_a_plans_estimate_must_be_of_its_own_stages(tmp_path, capfd):
    """show printed a hand-edited plan's stored estimate, per-rank layers and step time that no
    longer matched its stages (explain and export used the stages)."""
    model = "llama:layers=4,hidden=64,heads=4,kv_heads=2,vocab=256,seq_len=32"
    out = tmp_path / "pp2.json"
    assert main(["estimate", model, "--gpus", "4", "--dp", "2", "--pp", "2",
                 "--global-batch", "8", "--out", str(out)]) == 0
    capfd.readouterr()
    doc = json.loads(out.read_text())
    moved = json.loads(json.dumps(doc))
    first, second = moved["stages"]
    cut = first["layers"][1] - 1  # one layer from the first stage to the second
    first["layers"][1] = cut
    second["layers"][0] = cut + 1
    second["layer_names"].insert(0, first["layer_names"].pop())
    second["recompute"].insert(0, first["recompute"].pop())
    stale = _mutate(doc, ("estimate", "step_time_s"), 0)
    for edited, needle in ((moved, "the estimate's pipeline rank 0 holds layers"),
                           (stale, "does not hold its step_time_s 0")):
        file = tmp_path / "bad.json"
        file.write_text(json.dumps(edited))
        _fails(capfd, ["show", str(file)], needle)


def test_a_quantized_hf_config_is_planned_with_a_note(tmp_path, capfd):
    """A quantized checkpoint's config.json was planned as full training without a word."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256,
        "quantization_config": {"quant_method": "awq", "bits": 4}}))
    assert main(["estimate", str(config), "--gpus", "1", "--global-batch", "2", "--seq-len",
                 "32", "--json"]) == 0
    out, err = capfd.readouterr()
    json.loads(out)
    assert "autopar: note: the config's quantization_config (awq) is not modelled" in err


def test_an_output_is_never_the_input_nor_a_directory_name(tmp_path, capfd, plan_doc):
    """`--force` replaces an old output, never the plan being read (export overwrote it with
    Megatron flags); `--out name/` names a directory (it wrote a file `name`)."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_doc))
    before = plan.read_text()
    _fails(capfd, ["export", str(plan), "--to", "megatron", "--out", str(plan), "--force"],
           "is the file this command reads")
    _fails(capfd, ["export", str(plan), "--to", "megatron", "--out",
                   str(tmp_path / "." / "plan.json"), "--force"], "is the file this command reads")
    assert plan.read_text() == before
    _fails(capfd, ["export", str(plan), "--to", "megatron", "--out", str(tmp_path / "new") + "/"],
           "a directory's name")
    assert not (tmp_path / "new").exists()


def test_plan_never_writes_over_its_model_or_cluster_file(tmp_path, capfd):
    model = tmp_path / "m.py"
    model.write_text("raise SystemExit('not run: refused before the model is read')\n")
    _fails(capfd, ["plan", str(model), "--gpus", "2", "--global-batch", "8", "--out", str(model),
                   "--force"], "is the file this command reads")
    _fails(capfd, ["plan", TINY, "--cluster", str(CLUSTER), "--global-batch", "8", "--out",
                   str(CLUSTER), "--force"], "is the file this command reads")
    assert model.read_text().startswith("raise SystemExit")


def test_export_of_a_plan_that_does_not_fit_says_so(tmp_path, capfd):
    plan = tmp_path / "nofit.json"
    assert main(["estimate", TINY, "--gpus", "4", "--dp", "4", "--global-batch", "8",
                 "--gpu-memory", "0.001", "--out", str(plan)]) == 0
    capfd.readouterr()
    code = main(["export", str(plan), "--to", "torchtitan"])
    out, err = capfd.readouterr()
    assert code == 0 and out, err
    assert "autopar: note: the plan's estimate does not fit" in err
