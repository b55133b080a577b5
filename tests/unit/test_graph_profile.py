"""Profile structure: layers, parameters, TP layout, repeats, trace paths, errors, determinism."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import autopar
from autopar.errors import AutoparError, TraceError
from autopar.graph import LayerProfile, ModelProfile
from autopar.models import build


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights once


@settings(max_examples=3, deadline=None)
@given(
    kind=st.sampled_from(["gpt", "llama", "mlp"]),
    layers=st.integers(1, 3),
    heads=st.sampled_from([2, 4]),
    tie=st.booleans(),
)
def test_num_params_and_layers(kind: str, layers: int, heads: int, tie: bool) -> None:
    shape = {"layers": layers, "hidden": 64, "vocab": 80, "seq_len": 16}
    if kind == "llama":
        shape.update(heads=heads, kv_heads=heads // 2)
    elif kind == "gpt":
        shape.update(heads=heads, tie_embeddings=tie)
    model = build(kind, **shape)
    prof = autopar.profile(model)
    assert prof.num_params == _count(model)
    assert [layer.kind for layer in prof.layers] == ["embedding"] + ["block"] * layers + ["head"]
    assert [layer.name for layer in prof.layers[1:-1]] == [f"layers.{i}" for i in range(layers)]
    assert all(layer.module_fqns == (layer.name,) for layer in prof.layers[1:-1])
    assert [layer.repeat_of for layer in prof.layers[1:-1]] == [""] + ["layers.0"] * (layers - 1)
    assert prof.layers[-1].module_fqns == ("norm", "output")
    assert prof.num_blocks == layers and prof.trace_method == "fx"
    assert prof.tied_embeddings == (kind == "gpt" and tie)
    if prof.tied_embeddings:  # the shared weight is counted once, in the embedding
        assert prof.layers[-1].num_params == 2 * 64
    per_block = _count(model.layers["0"])
    assert all(layer.num_params == per_block for layer in prof.layers[1:-1])


def test_zoo_tp_structure() -> None:
    s, h = 16, 64
    prof = autopar.profile(
        build("llama", layers=2, hidden=h, heads=4, kv_heads=2, vocab=80, seq_len=s)
    )
    tp = prof.layers[2].tp
    assert tp.colwise == tuple(
        f"layers.1.{n}"
        for n in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "feed_forward.w1",
            "feed_forward.w3",
        )
    )
    assert tp.rowwise == ("layers.1.attention.wo", "layers.1.feed_forward.w2")
    assert tp.sequence == ("layers.1.attention_norm", "layers.1.ffn_norm")
    assert (tp.heads, tp.kv_heads) == (4, 2)
    assert tp.allreduce_fwd_bytes == 2 * s * h * 2  # two all-reduces of s h at bf16
    assert prof.layers[0].tp.vocab_parallel == ("tok_embeddings",)
    assert prof.layers[0].tp.allreduce_fwd_bytes == s * h * 2
    assert prof.layers[-1].tp.vocab_parallel == ("output",)
    assert prof.layers[-1].tp.sequence == ("norm",)


def test_profile_is_deterministic_and_leaves_model_alone() -> None:
    model = build("gpt", layers=2, hidden=64, heads=4, vocab=80, seq_len=16).eval()
    first = autopar.profile(model)
    second = autopar.profile(model)
    assert first.fingerprint() == second.fingerprint()
    assert ModelProfile.from_dict(first.to_dict()) == first
    assert all(p.dtype == torch.float32 and p.is_meta for p in model.parameters())
    assert not model.training
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert "forward" not in vars(model.layers["0"])


def test_seq_len_argument_changes_counts() -> None:
    model = build("gpt", layers=1, hidden=64, heads=4, vocab=80, seq_len=32)
    short = autopar.profile(model, seq_len=16)
    assert short.seq_len == 16
    assert short.layers[1].saved_bytes["full"] == 2 * 16 * 64


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class _UserModel(nn.Module):
    """A user's model: embedding, a ModuleList of blocks, norm + head."""

    def __init__(self, vocab: int = 50, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.proj = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.proj(self.ln(x))


def test_user_model_with_example_inputs() -> None:
    model = _UserModel()

    def example_inputs(batch_size: int) -> torch.Tensor:
        return torch.randint(0, 50, (batch_size, 12))

    prof = autopar.profile(model, example_inputs=example_inputs)
    assert prof.seq_len == 12 and prof.num_blocks == 3
    assert [layer.name for layer in prof.layers] == [
        "embedding",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "head",
    ]
    assert prof.layers[-1].module_fqns == ("ln", "proj")
    assert prof.num_params == _count(model)
    assert (prof.hidden, prof.vocab, prof.heads, prof.ffn_hidden) == (32, 50, 0, 128)
    block = prof.layers[1]
    assert block.fwd_flops == 2 * 2 * 12 * 32 * 128  # two linears, 2 s h f each
    assert block.tp.colwise == ("blocks.0.fc1",) and block.tp.rowwise == ("blocks.0.fc2",)
    # A batch given directly (any batch size) gives the same per-sample profile.
    direct = autopar.profile(model, example_inputs=torch.zeros(5, 12, dtype=torch.long))
    assert direct.fingerprint() == prof.fingerprint()


class _Boxed:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class _BoxedOutput(_UserModel):
    """Returns a custom object: neither fx nor torch.export can represent it."""

    def forward(self, tokens: torch.Tensor) -> _Boxed:  # type: ignore[override]
        return _Boxed(super().forward(tokens))


def test_untraceable_graph_falls_back_to_modules() -> None:
    prof = autopar.profile(_BoxedOutput(), seq_len=8)
    assert prof.trace_method == "modules"
    assert [layer.kind for layer in prof.layers] == ["embedding", "block", "block", "block", "head"]
    assert prof.layers[1].fwd_flops == 2 * 2 * 8 * 32 * 128


class _Untraceable(_UserModel):
    """fx cannot trace it (``int`` of a traced shape); it runs on meta tensors."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * (1.0 / int(tokens.shape[-1]))


def test_fx_failure_takes_the_order_of_the_profiling_run() -> None:
    """The module hooks of the profiler's own run give the order (no second tracer): the same
    embedding, blocks and head as fx finds in the traceable model."""
    prof = autopar.profile(_Untraceable(), seq_len=8)
    traced = autopar.profile(_UserModel(), seq_len=8)
    assert (prof.trace_method, traced.trace_method) == ("modules", "fx")
    assert [x.module_fqns for x in prof.layers] == [x.module_fqns for x in traced.layers]
    assert [x.num_params for x in prof.layers] == [x.num_params for x in traced.layers]


class _ValueDependent(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: needs real values
            return x
        return super().forward(x)


def test_value_dependent_model_raises_trace_error() -> None:
    model = _UserModel()
    model.blocks[1] = _ValueDependent(32)
    with pytest.raises(TraceError) as info:
        autopar.profile(model, seq_len=8)
    message = str(info.value)
    assert "\n" not in message
    assert "'blocks.1'" in message and "_ValueDependent" in message  # the module and its class
    assert "Tensor.item() cannot be called on meta tensors" in message  # the construct
    assert "shapes, not values" in message  # what to do


def test_bad_arguments() -> None:
    with pytest.raises(AutoparError, match="seq_len"):
        autopar.profile(_UserModel())
    with pytest.raises(AutoparError, match="dtype"):
        autopar.profile(_UserModel(), seq_len=8, dtype="int8")


def test_layer_record_round_trip() -> None:
    layer = autopar.profile(_UserModel(), seq_len=8).layers[1]
    assert LayerProfile.from_dict(layer.to_dict()) == layer


def test_model_without_blocks_is_one_layer() -> None:
    model = nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 40))
    prof = autopar.profile(model, seq_len=8)
    assert [(layer.name, layer.kind) for layer in prof.layers] == [("model", "other")]
    assert prof.num_params == _count(model) and prof.num_blocks == 0
    assert prof.layers[0].fwd_flops == 2 * 8 * 16 * 40


def test_real_weights_profile_like_meta() -> None:
    shape = {"layers": 1, "hidden": 32, "heads": 2, "vocab": 40, "seq_len": 8}
    real = build("gpt", device="cpu", seed=0, **shape)
    assert (
        autopar.profile(real).fingerprint() == autopar.profile(build("gpt", **shape)).fingerprint()
    )
    assert all(p.device.type == "cpu" for p in real.parameters())


MODEL_FILE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build_model():
    return Net()


def example_inputs(batch_size):
    return torch.randn(batch_size, 10, 4)


def loss_fn(output, batch):
    return ((output - batch.sum(-1, keepdim=True)) ** 2).mean()
"""


def test_model_file_with_loss_fn(tmp_path) -> None:
    path = tmp_path / "net.py"
    path.write_text(MODEL_FILE)
    loaded = autopar.load_model_file(path)
    model = loaded.instantiate()
    prof = autopar.profile(model, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn)
    assert prof.seq_len == 10 and prof.num_blocks == 2
    assert prof.num_params == _count(model)
    assert prof.layers[1].fwd_flops == 2 * 2 * 10 * 16 * 64


@settings(max_examples=6, deadline=None)
@given(hidden=st.sampled_from([32, 64, 96]), heads=st.sampled_from([2, 4]),
       kv_div=st.sampled_from([1, 2]), ffn=st.sampled_from([48, 128, 160]),
       seq=st.sampled_from([16, 24]))
def test_per_op_checkpointing_keeps_the_save_list_outputs(hidden, heads, kv_div, ffn, seq) -> None:
    """torchtitan's per-op policy on a Llama block keeps its input, the fused attention's output
    and log-sum-exp, and the outputs of the 1st, 3rd, 5th and 7th matmuls (wq, wv, w1, w2);
    it re-runs wk, wo and w3."""
    kv = heads // kv_div
    model = build("llama", layers=2, hidden=hidden, heads=heads, kv_heads=kv, vocab=64,
                  seq_len=seq, ffn_hidden=ffn)
    prof = autopar.profile(model, seq_len=seq)
    block = next(x for x in prof.layers if x.kind == "block")
    w, head_dim = 2, hidden // heads  # bf16 profile
    kept = seq * (hidden + hidden + kv * head_dim + ffn + hidden + hidden) * w + heads * seq * 4
    assert block.op_sac.saved_bytes == kept
    rerun = 2 * seq * hidden * (kv * head_dim + hidden + ffn)
    assert block.op_sac.recompute_flops == rerun
    assert block.op_sac.saved_bytes < block.saved_bytes["none"]
    assert LayerProfile.from_dict(block.to_dict()) == block
