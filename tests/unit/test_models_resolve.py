"""MODEL arguments: kind:key=value specs, presets, model files, HF configs and plan files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopar.errors import ModelFileError, UnknownModelError
from autopar.models import parse_model_spec, resolve_model

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"


def test_parse_model_spec():
    kind, shape = parse_model_spec("gpt:layers=4,hidden=64,heads=4,vocab=256,seq_len=32")
    assert kind == "gpt"
    assert shape == dict(layers=4, hidden=64, heads=4, vocab=256, seq_len=32)
    kind, shape = parse_model_spec(
        "llama: layers=4, hidden=64, heads=4, kv_heads=2, vocab=256, seq_len=32, "
        "attention=eager, rope_theta=500000, tie_embeddings=true"
    )
    assert kind == "llama" and shape["kv_heads"] == 2 and shape["attention"] == "eager"
    assert shape["rope_theta"] == 500000.0 and shape["tie_embeddings"] is True


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gtp:layers=4", "Did you mean 'gpt'"),
        ("gpt layers=4", "expected KIND:key=value"),
        ("gpt:layers", "'layers' is not key=value"),
        ("gpt:layers=4,hiden=64", "unknown key 'hiden'"),
        ("gpt:layers=four,hidden=64,heads=4,vocab=8,seq_len=8", "layers='four'"),
        ("gpt:layers=4,layers=5", "given twice"),
        # int() and float() spellings that are not plain decimals
        ("gpt:layers=4_0,hidden=64,heads=4,vocab=8,seq_len=8", "layers='4_0'"),
        ("gpt:layers=\u0664,hidden=64,heads=4,vocab=8,seq_len=8", "is not a valid value"),
        ("gpt:layers=4,hidden=64,heads=4,vocab=8,seq_len=8,dropout=nan", "dropout='nan'"),
        ("gpt:layers=4,hidden=64,heads=4,vocab=8,seq_len=8,dropout=1_0", "dropout='1_0'"),
        ("gpt:layers=4,hidden=64,heads=5,vocab=8,seq_len=8", "heads=5 must divide hidden=64"),
        ("gpt:layers=4,hidden=64", "needs heads, vocab, seq_len"),
        ("mlp:layers=2,hidden=8,heads=2,vocab=8,seq_len=4", "unknown key 'heads'"),
    ],
)
def test_parse_model_spec_errors(text, message):
    with pytest.raises(UnknownModelError, match=message):
        parse_model_spec(text)


def test_resolve_preset_and_spec():
    builder, description = resolve_model("gpt2")
    assert builder().autopar_spec.name == "gpt2" and "gpt2" in description
    builder, _ = resolve_model("llama:layers=2,hidden=32,heads=4,kv_heads=2,vocab=64,seq_len=8")
    model = builder("cpu", seed=0)
    assert next(model.parameters()).device.type == "cpu"
    assert model.autopar_spec.kv_heads == 2


def test_resolve_unknown_name():
    with pytest.raises(UnknownModelError, match="Did you mean 'llama3-8b'"):
        resolve_model("llama3-8")


def test_resolve_model_file():
    builder, description = resolve_model(str(FIXTURES / "tiny_mlp.py"))
    assert "tiny_mlp.py" in description
    assert next(builder("meta").parameters()).device.type == "meta"
    with pytest.raises(ModelFileError, match="does not exist"):
        resolve_model("no/such/model.py")


def test_resolve_json(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema_version": 1, "config": {}}))
    with pytest.raises(UnknownModelError, match="is an autopar plan"):
        resolve_model(str(plan))
    other = tmp_path / "other.json"
    other.write_text("[1, 2]")
    with pytest.raises(UnknownModelError, match="neither an HF config"):
        resolve_model(str(other))
    with pytest.raises(UnknownModelError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.json"))
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 128,
    }))  # fmt: skip
    builder, description = resolve_model(str(config))
    assert "llama" in description
    assert builder().num_parameters() > 0


def test_model_file_builder_respects_callers_device():
    builder, _ = resolve_model(str(FIXTURES / "tiny_mlp.py"))
    with torch.device("meta"):
        assert next(builder().parameters()).device.type == "meta"
    assert next(builder().parameters()).device.type == "cpu"
    assert next(builder(device="meta").parameters()).device.type == "meta"
