"""Exports quote every string a plan carries: a plan is data and never becomes a command.

A plan JSON is written by anyone; its ``model`` field and its stage names reach the exported
Slurm script and TOML. Each must stay one quoted value (or one comment line) of its language.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

import pytest
import tomllib
from report_fixtures import make_plan

from autopar.exporters import export_plan, toml_string

EVIL = "x\n#SBATCH --evil\nrm -rf /"
NASTY = ['a"b', "back\\slash", "tab\there", "nl\nline", "cr\rline", "del\x7fchar", "bell\x07",
         "null\x00byte", "unicode \u00e9\u2028sep", "emoji \U0001f600", "", "'single'"]


def _evil_plan(model: str = EVIL):
    # zero=0 with dp=2: a split every export target runs.
    plan = make_plan(dp=2, tp=1, pp=1, schedule="1f1b", virtual_stages=1, zero=0)
    if model.isprintable():
        return dataclasses.replace(plan, model=model)
    # A Plan refuses a model that is not one printable line when it is made or read
    # (test_api_inputs); the exporters quote it anyway, should one reach them: set past the check.
    with pytest.raises(ValueError, match="one line of printable text"):
        dataclasses.replace(plan, model=model)
    object.__setattr__(plan, "model", model)
    return plan


def _no_injected_line(text: str) -> None:
    for line in text.splitlines():
        assert not line.startswith(("#SBATCH --evil", "rm ")), line
        assert "\r" not in line


def test_slurm_script_keeps_the_model_on_one_comment_line():
    text = export_plan(_evil_plan(), "slurm").text
    _no_injected_line(text)
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    options = [re.match(r"#SBATCH --([a-z-]+)", line).group(1) for line in sbatch]
    assert options == ["job-name", "nodes", "ntasks-per-node", "gpus-per-node", "exclusive"]
    assert re.fullmatch(r"#SBATCH --job-name=[A-Za-z0-9_.-]+", sbatch[0]), sbatch[0]
    if shutil.which("bash"):
        proc = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True,
                              check=False)
        assert proc.returncode == 0, proc.stderr


def test_torchtitan_toml_keeps_the_model_a_string():
    text = export_plan(_evil_plan(), "torchtitan").text
    _no_injected_line(text)
    doc = tomllib.loads(text)
    assert EVIL in doc["job"]["description"]
    assert doc["job"]["description"].startswith(f"autopar plan for {EVIL}: ")


@pytest.mark.parametrize("value", NASTY)
def test_toml_string_round_trips(value):
    assert tomllib.loads(f"v = {toml_string(value)}\n")["v"] == value
    assert toml_string(value).isascii()


def test_toml_string_refuses_lone_surrogates():
    with pytest.raises(ValueError, match="not valid Unicode"):
        toml_string("bad \ud800")


@pytest.mark.parametrize("value", NASTY)
def test_every_export_survives_odd_model_names(value):
    plan = _evil_plan(value)
    toml = tomllib.loads(export_plan(plan, "torchtitan").text)
    assert toml["job"]["description"].startswith(f"autopar plan for {value or 'model'}: ")
    slurm = export_plan(plan, "slurm").text
    assert len(slurm.splitlines()) == len(export_plan(_evil_plan("m"), "slurm").text.splitlines())


def test_stage_modules_from_the_plan_never_reach_the_toml():
    plan = make_plan(schedule="1f1b", virtual_stages=1, zero=0)
    second = plan.stages[1]
    # Still the same block to the plan's own checks (a name ending in .layers.N).
    odd = 'x"\n[evil]\nx = 1.' + second.layer_names[0]
    names = (odd, *second.layer_names[1:])
    stages = (plan.stages[0], dataclasses.replace(second, layer_names=names))
    text = export_plan(dataclasses.replace(plan, stages=stages), "torchtitan").text
    doc = tomllib.loads(text)
    assert "evil" not in doc
    assert "module_fqns_per_model_part" not in doc["parallelism"]
    notes = export_plan(dataclasses.replace(plan, stages=stages), "torchtitan").notes
    assert any("module_fqns_per_model_part by hand" in note for note in notes)
