"""Fuzz of the command line (issue 13): numbers, cluster YAML fields and plan JSON mutations.

Every example ends with exit 0 or 2; on 2 with exactly one ``autopar: error:`` line, no
traceback and no file left behind; on 0 with ``--json``, valid JSON on stdout; each in bounded
time. Deterministic (derandomize) and small enough for the unit tier.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.cli import main

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq_len=16"
CLUSTER = Path(__file__).parents[1] / "fixtures" / "clusters" / "a100_2nodes.yaml"
FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
NUMBERS = st.sampled_from(["0", "-4", "1", "2", "8", "1e3", "2.5", "nan", "inf", "-inf",
                           "1e100", str(2**62), "x", "", ","])


def _check(capfd, argv, out_file=None, seconds=20.0):
    start = time.monotonic()
    code = main(argv)
    assert time.monotonic() - start < seconds
    out, err = capfd.readouterr()
    assert code in (0, 2), err
    assert "Traceback" not in err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("autopar: error: "), err
        assert out_file is None or not Path(out_file).exists()
    elif "--json" in argv:
        json.loads(out)
    return code


@FUZZ
@given(flag=st.sampled_from(["--gpus", "--global-batch", "--seq-len", "--gpu-memory",
                             "--top-k", "--time-budget", "--build-timeout"]), value=NUMBERS)
def test_plan_numbers(tmp_path, capfd, flag, value):
    out = tmp_path / "p.json"
    out.unlink(missing_ok=True)
    argv = ["plan", TINY, "--gpus", "1", "--global-batch", "4", "--json", "--out", str(out),
            "--force", flag, value]
    if _check(capfd, argv, out) == 0:
        out.unlink()


@FUZZ
@given(flag=st.sampled_from(["--dp", "--tp", "--pp", "--micro-batch", "--global-batch",
                             "--virtual-stages", "--zero"]), value=NUMBERS)
def test_estimate_numbers(capfd, flag, value):
    _check(capfd, ["estimate", TINY, "--global-batch", "4", "--json", flag, value])


@FUZZ
@given(field=st.sampled_from(["nodes", "gpus_per_node", "peak_bf16_flops", "memory_bytes",
                              "bandwidth_bytes_per_s", "latency_s", "memory_headroom_fraction"]),
       value=st.sampled_from(["0", "-1", "1e-300", "1e100", ".nan", ".inf", "fast", "[]", "{}"]))
def test_cluster_yaml_fields(tmp_path, capfd, field, value):
    lines = CLUSTER.read_text().splitlines()
    text = "\n".join(
        line.split(":")[0] + f": {value}" if line.strip().startswith(field + ":") else line
        for line in lines
    )
    path = tmp_path / "c.yaml"
    path.write_text(text)
    _check(capfd, ["estimate", TINY, "--cluster", str(path), "--global-batch", "16",
                   "--dp", "16", "--json"])


_PLAN: dict = {}  # the base plan, made once by the first example


@FUZZ
@given(section=st.sampled_from(["estimate", "config", "cluster"]), index=st.integers(0, 40),
       value=st.sampled_from([None, "fast", -1, 0, 10**30, 1e308, [], {}, True, 3.5]))
def test_plan_json_mutations(tmp_path, capfd, section, index, value):
    if not _PLAN:
        path = tmp_path / "base.json"
        assert main(["plan", TINY, "--gpus", "2", "--global-batch", "4", "--out", str(path),
                     "--force"]) == 0
        _PLAN.update(json.loads(path.read_text()))
        capfd.readouterr()
    doc = json.loads(json.dumps(_PLAN))
    keys = sorted(doc[section])
    doc[section][keys[index % len(keys)]] = value
    path = tmp_path / "mutant.json"
    path.write_text(json.dumps(doc))
    for command in (["show", str(path)], ["export", str(path), "--to", "deepspeed"]):
        _check(capfd, command)


@FUZZ
@given(kind=st.sampled_from(["gpt", "llama", "mlp"]),
       key=st.sampled_from(["layers", "hidden", "heads", "kv_heads", "vocab", "seq_len",
                            "rope_theta", "dropout", "bogus"]),
       value=st.sampled_from(["0", "-1", "nan", "inf", "65", "1e9", "x"]))
def test_model_specs(capfd, kind, key, value):
    spec = f"{kind}:layers=2,hidden=32,heads=2,vocab=64,seq_len=16,{key}={value}"
    if kind == "mlp":
        spec = f"mlp:layers=2,hidden=32,vocab=64,seq_len=16,{key}={value}"
    _check(capfd, ["estimate", spec, "--global-batch", "2", "--json"])
