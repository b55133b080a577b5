"""Runtime checks and splitting that need no process group: errors before launch, stage FQNs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autopar.config import ParallelConfig
from autopar.cost_model.estimate import Estimate, MemoryBreakdown, TimeBreakdown
from autopar.errors import AutoparError, PlanMismatchError
from autopar.models import build, make_spec
from autopar.plan import Plan, StagePlan
from autopar.runtime.apply import check_plan_runnable
from autopar.runtime.pipeline_parallel import find_structure, split_stage
from autopar.runtime.tensor_parallel import default_tp_layout, resolve_layout

GPT = {"layers": 4, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 8}
LLAMA = {"layers": 4, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64, "seq_len": 8}


def _plan(num_blocks: int = 4, layout: dict[str, str] | None = None, **cfg: Any) -> Plan:
    config = ParallelConfig(global_batch=cfg.pop("global_batch", 8), dtype="fp32", **cfg)
    names = ["embedding"] + [f"layers.{i}" for i in range(num_blocks)] + ["head"]
    base, extra = divmod(len(names), config.num_stages)
    stages, first = [], 0
    for index in range(config.num_stages):
        size = base + (1 if index < extra else 0)
        stages.append(StagePlan(index=index, layers=(first, first + size - 1),
                                layer_names=tuple(names[first:first + size]),
                                recompute=(config.recompute,) * size))
        first += size
    estimate = Estimate(
        step_time_s=0.0, tokens_per_s=0.0, tflops_per_gpu=0.0, hardware_tflops_per_gpu=0.0,
        mfu=0.0, memory_per_gpu_bytes=0.0, memory_capacity_bytes=0.0, fits=True,
        time_breakdown=TimeBreakdown(), memory_breakdown=MemoryBreakdown(),
    )
    return Plan(config=config, stages=tuple(stages), estimate=estimate, tp_layout=layout or {})


@pytest.mark.parametrize(
    ("shape", "cfg", "match"),
    [
        (dict(LLAMA, heads=4, kv_heads=1), {"tp": 2}, "kv_heads = 1"),
        (dict(GPT, heads=2, hidden=32), {"tp": 4}, "heads = 2"),
        (dict(GPT, seq_len=6), {"tp": 4, "sequence_parallel": True}, "seq_len"),
        (GPT, {"pp": 4, "global_batch": 2}, "1f1b needs at least"),
        (dict(GPT, seq_len=6), {"cp": 2}, r"multiple of 2 \* cp = 4"),
        (dict(GPT, seq_len=12), {"cp": 2, "tp": 4, "sequence_parallel": True}, "seq_len / cp"),
    ],
)
def test_unrunnable_plans_fail_before_launch(shape: dict, cfg: dict, match: str) -> None:
    plan = _plan(**cfg)
    kind = "llama" if "kv_heads" in shape else "gpt"
    with pytest.raises(AutoparError, match=match):
        check_plan_runnable(make_spec(kind, **shape), plan)
    with pytest.raises(AutoparError, match=match):
        check_plan_runnable(build(kind, **shape), plan)  # meta device


def test_a_tied_embedding_and_head_split_only_when_both_shard_over_the_vocabulary() -> None:
    """The runtime splits a weight tied between the token embedding and the lm head (pp: two
    copies, tp: one vocab-parallel DTensor; tied_weights.py), not a layout sharding them
    differently, nor a weight tied between other modules."""
    tied = dict(GPT, tie_embeddings=True)
    for cfg in ({"pp": 2}, {"tp": 2}, {"pp": 2, "tp": 2}):
        check_plan_runnable(build("gpt", **tied), _plan(**cfg))
    hidden_split = {"tok_embeddings": "colwise"}
    with pytest.raises(AutoparError, match="does not shard both over the vocabulary"):
        check_plan_runnable(build("gpt", **tied), _plan(layout=hidden_split, tp=2))
    blocks_tied = build("gpt", **GPT)
    blocks_tied.layers["1"].attention.wq.weight = blocks_tied.layers["0"].attention.wq.weight
    with pytest.raises(AutoparError, match="only between the token embedding and the lm head"):
        check_plan_runnable(blocks_tied, _plan(pp=2))


def test_plan_for_another_model_is_a_mismatch() -> None:
    with pytest.raises(PlanMismatchError, match="blocks"):
        check_plan_runnable(build("gpt", **GPT), _plan(num_blocks=6))


def test_model_without_block_container_is_rejected() -> None:
    # Data parallelism runs any module; tensor and pipeline splits need a block container.
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
    check_plan_runnable(model, _plan(num_blocks=0, dp=2))
    with pytest.raises(AutoparError, match=r"block container.*--dp 2"):
        check_plan_runnable(model, _plan(num_blocks=0, tp=2))


def test_context_parallel_needs_an_attention_autopar_runs() -> None:
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
    with pytest.raises(AutoparError, match=r"cannot run with cp=2.*its own code"):
        check_plan_runnable(model, _plan(num_blocks=0, cp=2))
    check_plan_runnable(build("llama", **LLAMA), _plan(cp=2))


def test_context_parallel_shards_are_load_balanced() -> None:
    from autopar.runtime.context_parallel import ContextParallel, shard_sequence

    tokens = torch.arange(16).view(1, 16)
    shards = [shard_sequence(tokens, r, 2) for r in range(2)]
    assert [s.tolist() for s in shards] == [[[0, 1, 2, 3, 12, 13, 14, 15]],
                                            [[4, 5, 6, 7, 8, 9, 10, 11]]]
    for rank, shard in enumerate(shards):
        cp = ContextParallel(rank=rank, size=2, group=None)
        assert cp.positions(8, torch.device("cpu")).tolist() == shard[0].tolist()
        mask = cp.causal_mask(8, torch.device("cpu"))
        keys = torch.cat([s[0] for s in shards])
        assert torch.equal(mask, keys[None, :] <= shard[0][:, None])


def test_bad_layout_style_is_rejected() -> None:
    layout = dict(default_tp_layout(build("gpt", **GPT)), **{"layers.*.ffn_norm": "rowwise"})
    with pytest.raises(AutoparError, match="ffn_norm"):
        check_plan_runnable(build("gpt", **GPT), _plan(tp=2, layout=layout))


def test_sequence_parallel_needs_every_norm_sequence() -> None:
    layout = {k: v for k, v in default_tp_layout(build("gpt", **GPT)).items() if k != "norm"}
    with pytest.raises(AutoparError, match="norm"):
        check_plan_runnable(build("gpt", **GPT), _plan(tp=2, sequence_parallel=True, layout=layout))
    check_plan_runnable(build("gpt", **GPT), _plan(tp=2, layout=layout))  # fine without SP


def test_default_layout_is_megatron() -> None:
    model = build("llama", **LLAMA)
    resolved = resolve_layout(model, default_tp_layout(model))
    assert resolved["layers.3.attention.wk"] == "colwise"
    assert resolved["layers.0.feed_forward.w2"] == "rowwise"
    assert resolved["layers.1.attention_norm"] == "sequence"
    assert resolved["tok_embeddings"] == "rowwise" and resolved["output"] == "colwise"


@pytest.mark.parametrize(("kind", "shape"), [("gpt", GPT), ("llama", LLAMA)])
@pytest.mark.parametrize("num_stages", [2, 3, 6])
def test_stages_keep_fqns_and_chain_to_the_full_forward(kind: str, shape: dict,
                                                         num_stages: int) -> None:
    model = build(kind, device="cpu", seed=0, **shape)
    plan = _plan(pp=num_stages, schedule="gpipe", global_batch=num_stages)
    structure = find_structure(model)
    parts = [split_stage(model, stage, structure) for stage in plan.stages]
    full = dict(model.named_parameters())
    owned = [dict(part.named_parameters()) for part in parts]
    assert sum(len(o) for o in owned) == len(full)
    for o in owned:
        for fqn, param in o.items():
            assert full[fqn] is param  # same object, original FQN
    tokens = torch.randint(0, shape["vocab"], (2, shape["seq_len"]))
    h = tokens
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)


class _ListModel(nn.Module):
    """A user model with its blocks in a ModuleList that runs whatever parts are present."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.head: nn.Module | None = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def test_module_list_blocks_split_with_original_fqns() -> None:
    torch.manual_seed(0)
    model = _ListModel()
    plan = _plan(num_blocks=3, pp=2, schedule="gpipe", global_batch=2)
    check_plan_runnable(model, plan)
    structure = find_structure(model)
    assert (structure.container, structure.before, structure.after) == ("blocks", ("embed",),
                                                                       ("head",))
    parts = [split_stage(model, stage, structure) for stage in plan.stages]
    assert {n for n, _ in parts[1].named_parameters()} == {
        "blocks.2.0.weight", "blocks.2.0.bias", "head.weight", "head.bias"}
    tokens = torch.randint(0, 16, (2, 5))
    torch.testing.assert_close(parts[1](parts[0](tokens)), model(tokens), rtol=0, atol=0)


NANOGPT = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "tiny_nanogpt_split.py"


def _nanogpt(path: Path = NANOGPT) -> nn.Module:
    from autopar.models import load_model_file

    return load_model_file(path).instantiate("meta")


def test_nested_container_structure_and_layout() -> None:
    # nanoGPT: blocks at transformer.h; the head runs inside out (ln_f before lm_head).
    model = _nanogpt()
    structure = find_structure(model)
    assert structure.nested and structure.container == "transformer.h"
    assert structure.before == ("transformer.wte", "transformer.wpe")
    assert structure.after == ("transformer.ln_f", "lm_head")
    layout = default_tp_layout(model)
    assert layout["transformer.h.*.attn.c_attn"] == "colwise_qkv"
    assert layout["transformer.h.*.attn.c_proj"] == "rowwise"
    assert layout["transformer.h.*.mlp.c_proj"] == "rowwise"
    assert layout["transformer.h.*.mlp.c_fc"] == "colwise"
    check_plan_runnable(model, _plan(2, tp=2, sequence_parallel=True, micro_batch=4))


def test_nested_stages_keep_full_model_fqns() -> None:
    model = _nanogpt()
    plan = _plan(2, pp=2, micro_batch=4)
    structure = find_structure(model)
    names = [{n for n, _ in split_stage(model, s, structure).named_parameters()}
             for s in plan.stages]
    assert "transformer.wte.weight" in names[0] and "lm_head.weight" in names[1]
    assert not names[0] & names[1]
    assert names[0] | names[1] == {n for n, _ in model.named_parameters()}


def test_fused_attention_sized_by_its_input_is_refused(tmp_path: Path) -> None:
    # nanoGPT verbatim takes the width from x (C = x.size(-1)): one rank's share breaks its views.
    text = NANOGPT.read_text().replace("B, T, _ = x.size()", "B, T, C = x.size()")
    text = text.replace("head_size = self.n_embd // self.n_head", "head_size = C // self.n_head")
    path = tmp_path / "verbatim.py"
    path.write_text(text)
    with pytest.raises(AutoparError, match=r"attention transformer\.h\.0\.attn .* --pp or --dp"):
        check_plan_runnable(_nanogpt(path), _plan(2, tp=2, micro_batch=4))
    with pytest.raises(AutoparError, match=r"transformer\.h\.0\.attn\.c_attn .* \(--zero 0\)"):
        check_plan_runnable(_nanogpt(), _plan(2, tp=2, dp=2, zero=3, micro_batch=2))
    # FSDP2 over one rank to offload recuts them too: the fix is no offload, not zero 0.
    with pytest.raises(AutoparError, match=r"c_attn .*\(--offload none\)"):
        check_plan_runnable(_nanogpt(), _plan(2, tp=2, zero=1, offload="optimizer"))


def test_an_hf_model_whose_heads_tp_does_not_divide_fails_before_launch() -> None:
    from autopar.models.hf import from_hf_config

    config = {"model_type": "llama", "hidden_size": 48, "num_hidden_layers": 4,
              "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 64,
              "vocab_size": 64}
    with pytest.raises(AutoparError, match=r"tp = 4 must divide num_attention_heads .*= 6"):
        check_plan_runnable(from_hf_config(config), _plan(tp=4))
    check_plan_runnable(from_hf_config(config), _plan(tp=2))
