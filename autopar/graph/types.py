"""Records produced by profiling: ModelProfile and LayerProfile.

All counts are per sample (one sequence of ``seq_len`` tokens) at the dtype the model was profiled
in (``ModelProfile.dtype``); the cost model scales them by micro-batch size and rescales bytes to
the training dtype. FLOPs count multiply-adds as 2 (a (m x k)(k x n) matmul is 2mkn FLOPs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LayerProfile", "MoEStructure", "ModelProfile", "TPStructure"]

LAYER_KINDS = ("embedding", "block", "head", "other")


@dataclass(frozen=True, slots=True, kw_only=True)
class TPStructure:
    """How a layer shards over tensor parallelism, in torch's ParallelStyle vocabulary.

    Attributes:
        colwise: FQNs (relative to the model root) of linears to shard column-wise.
        rowwise: FQNs of linears to shard row-wise.
        sequence: FQNs of norms that run sequence-parallel when SP is on.
        vocab_parallel: FQNs of the embedding / lm-head that can be sharded over the vocabulary.
        heads: attention heads of this layer (0 if none); tp must divide it.
        kv_heads: key/value heads (GQA); tp must divide it.
        allreduce_fwd_bytes: bytes per sample all-reduced over tp in this layer's forward
            (Megatron: 2 all-reduces of s*h per block); backward moves the same.
        sequence_param_tensors: parameter tensors of the ``sequence`` norms (LayerNorm: weight
            and bias; RMSNorm: weight). With sequence parallelism each one's gradient is partial
            over tp and is all-reduced at every gradient reduction when dp > 1.
        sequence_param_elements: elements of those parameters in all.
        fused_qkv: the ``colwise`` linears that compute q, k and v in one matrix (equal widths):
            each rank keeps its share of the heads of each of q, k and v.
        split_blocker: why the traced modules themselves cannot be split this way ("" when
            they can; ``graph.tp.split_blocker``): a framework that runs its own code splits
            them regardless, autopar's runtime does not (in JSON only when set).
        width_norms: norms over a column-parallel linear's whole output, all heads together
            (OLMo 2's ``q_norm`` and ``k_norm``; ``graph.tp.width_norms``): split with the
            features, their statistics all-reduced over tp forward and backward (in JSON only
            when set).
        sp_blocker: why autopar's runtime cannot run the layer sequence-parallel ("" when it
            can): a norm after the token embedding (BLOOM's), whose model builds its own
            shapes from the whole sequence (in JSON only when set).
    """

    colwise: tuple[str, ...] = ()
    rowwise: tuple[str, ...] = ()
    sequence: tuple[str, ...] = ()
    fused_qkv: tuple[str, ...] = ()
    vocab_parallel: tuple[str, ...] = ()
    heads: int = 0
    kv_heads: int = 0
    allreduce_fwd_bytes: int = 0
    sequence_param_tensors: int = 0
    sequence_param_elements: int = 0
    split_blocker: str = ""
    width_norms: tuple[str, ...] = ()
    sp_blocker: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class OpSacCounts:
    """A block under per-op selective checkpointing (torchtitan's ``selective_ac_option="op"``:
    the block's input and the outputs of its save list are kept, the rest re-runs; see
    graph/recorder.py), per sample.

    Attributes:
        saved_bytes: bytes kept for backward.
        saved_bytes_replicated: the part tensor parallelism does not shard.
        recompute_flops: forward FLOPs the backward re-runs.
    """

    saved_bytes: int
    saved_bytes_replicated: int
    recompute_flops: float


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEStructure:
    """The mixture of experts of one layer (what the cost model needs for expert parallelism).

    Attributes:
        experts: routed experts E.
        top_k: experts per token k.
        shared_experts: shared experts (every token; dense, replicated over ep), counted in
            units of ``expert_hidden``.
        hidden: model width h (the width of a dispatched token).
        expert_hidden: inner width f_e of one routed expert.
        expert_params: parameters of one routed expert (SwiGLU: 3 h f_e).
        capacity_factor: c (0: dropless).
        router_imbalance: under dropless routing, the busiest expert-parallel rank's routed
            rows over the average, as the model states it (``ModelSpec.router_imbalance``; 0:
            unknown, the cost model's default). In JSON only when set.
        ep_blocker: why autopar's runtime cannot run the traced experts one at a time and so
            shard them over ep ("" when it can; ``graph.moe.ep_blocker``): a framework that
            runs its own code shards them regardless (in JSON only when set).
        module: the path, relative to its block, of the module holding the router and the
            experts ("moe", "mlp", "feed_forward"); "" where no one module holds both (the
            experts' parent holds no router). Under sequence parallelism autopar's runtime
            gathers the whole sequence into that module (framework_support
            ``moe_tp_mode``), so the tp collectives of its linears differ from the
            rest of the block's. In JSON only when set.
        expert_tp_folded: the routed experts run whole on each rank of a tensor-parallel
            layer, each tp rank routing its own tokens to an ep group of consecutive ranks
            (Megatron-Core's ``--expert-tensor-parallel-size 1``). Never profiled: the cost
            model's view of a layer as such a framework runs it
            (``cost_model.expert_tp.folded_experts``). In JSON only when set.
    """

    experts: int
    top_k: int
    shared_experts: int = 0
    hidden: int
    expert_hidden: int
    expert_params: int
    capacity_factor: float = 0.0
    router_imbalance: float = 0.0
    ep_blocker: str = ""
    module: str = ""
    expert_tp_folded: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the record."""
        data = dataclasses.asdict(self)
        for name in ("router_imbalance", "ep_blocker", "module", "expert_tp_folded"):
            if not data[name]:
                del data[name]
        return data

    def holds(self, fqn: str) -> bool:
        """Whether the module ``fqn`` (a full FQN in one of the model's blocks: the first
        all-digit segment is the block index) lies inside the MoE module (``module``)."""
        if not self.module:
            return False
        parts = fqn.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if index is None:
            return False
        return ".".join(parts[index + 1:]).startswith(self.module + ".")

    @property
    def routed_params(self) -> int:
        """Parameters of all routed experts (the ones expert parallelism shards): E * P_e."""
        return self.experts * self.expert_params

    def routed_rows_per_token(self) -> float:
        """Dispatched rows per token: k, or E ceil(c T k / E) / T ~ c k with a capacity factor
        (the limit of large T, which is how the profile's per-sample difference counts it)."""
        if self.capacity_factor > 0:
            return self.capacity_factor * self.top_k
        return float(self.top_k)

    def routed_fwd_flops(self, tokens: int) -> float:
        """Forward FLOPs of the routed experts on ``tokens`` tokens: 2 * rows * P_e."""
        return 2.0 * tokens * self.routed_rows_per_token() * self.expert_params

    def routed_saved_bytes_per_row(self, dtype_bytes: int) -> float:
        """Bytes a SwiGLU expert saves for backward per dispatched row: its input and output
        rows (2 h) and its gate, up, activated gate and product (4 f), at ``dtype_bytes``."""
        return (2 * self.hidden + 4 * self.expert_hidden) * dtype_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerProfile:
    """One pipeline-placeable layer: the embedding, a transformer block, or the norm + head + loss.

    Attributes:
        name: display name, e.g. "embedding", "layers.3", "head".
        kind: embedding | block | head | other.
        module_fqns: FQNs of the modules this layer owns, e.g. ("tok_embeddings",).
        num_params: parameters owned by this layer (a tied weight counted once, at its first use).
        param_bytes: bytes of those parameters at the profile dtype.
        fwd_flops: forward FLOPs per sample (attention as the fused kernel, causal mask ignored).
        bwd_flops: backward FLOPs per sample (2x forward for matmuls).
        recompute_flops: extra forward FLOPs per sample under each recompute mode
            ({"none": 0, "selective": attention core, "full": fwd_flops}).
        saved_bytes: bytes saved for backward per sample under each recompute mode, storages
            de-duplicated ({"none"|"selective"|"full": bytes}).
        saved_bytes_replicated: the part of ``saved_bytes`` that tensor parallelism does not shard
            (norm inputs, residual stream, dropout masks on the residual: Korthikanti's 10sbh);
            sequence parallelism shards it too. The rest is sharded by tp.
        output_bytes: bytes of the layer's output per sample (what a pipeline stage sends).
        tp: the tensor-parallel structure.
        repeat_of: name of the layer whose measurements this one shares (repeated blocks), or "".
        op_sac: the block's counts under per-op selective checkpointing (None: not measured,
            e.g. an analytic profile or a non-block layer).
        moe: the layer's mixture of experts (None for a dense layer); its routed experts are
            counted in ``fwd_flops`` / ``num_params`` like everything else (graph/moe.py).
        swiglu_saved_bytes: the part of ``saved_bytes`` (none, selective) per sample that is
            SwiGLU's activated gate, silu's output (tensor-parallel sharded): what a fused
            SwiGLU kernel recomputes instead of keeping (graph/recorder.py).
        kv_repeat_saved_bytes: the part of ``saved_bytes`` (none, selective) per sample that
            repeats grouped-query attention's K/V heads beyond one copy (tensor-parallel
            sharded): what an attention kernel that reads the kv heads in place does not keep
            (graph/recorder.py).
        linear_saved_bytes: (all, replicated part) of ``saved_bytes`` (none, selective) per
            sample that only weight matmuls keep, their inputs for the weight gradient.
        linear_shared_bytes: (all, replicated part) per sample that a weight matmul keeps and
            another op keeps too (graph/recorder.py): with the first, what an fp8 linear that
            keeps its fp8 input changes (cost_model/layer_terms.py).
        norm_saved_bytes: (all, replicated part) of ``saved_bytes`` (none, selective) per
            sample that composite norms keep beyond a fused norm kernel (graph/recorder.py).
        combine_saved_bytes: (all, replicated part) per sample that ``index_add`` keeps of
            the expert outputs it combines, which a scatter combine does not (recorder.py).
        weight_pass_grad_bytes: (all, tp-replicated part, part sequence parallelism does not
            shard either) per sample that a split backward keeps from the input pass to the
            weight pass: the output gradients of the layer's weight ops (graph/recorder.py).
        input_pass_freed_bytes: (all, replicated part) of ``saved_bytes`` (none, selective) per
            sample that the input pass of a split backward frees: saved only after the layer's
            last weight op (the loss; graph/recorder.py).
    """

    name: str
    kind: str
    module_fqns: tuple[str, ...]
    num_params: int
    param_bytes: int
    fwd_flops: float
    bwd_flops: float
    recompute_flops: dict[str, float]
    saved_bytes: dict[str, int]
    saved_bytes_replicated: dict[str, int]
    output_bytes: int
    tp: TPStructure = field(default_factory=TPStructure)
    repeat_of: str = ""
    op_sac: OpSacCounts | None = None
    moe: MoEStructure | None = None
    swiglu_saved_bytes: int = 0
    kv_repeat_saved_bytes: int = 0
    linear_saved_bytes: tuple[int, int] = (0, 0)
    linear_shared_bytes: tuple[int, int] = (0, 0)
    norm_saved_bytes: tuple[int, int] = (0, 0)
    combine_saved_bytes: tuple[int, int] = (0, 0)
    weight_pass_grad_bytes: tuple[int, int, int] = (0, 0, 0)
    input_pass_freed_bytes: tuple[int, int] = (0, 0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the record (no ``moe`` key for a dense layer)."""
        data = dataclasses.asdict(self)
        if self.moe is None:
            del data["moe"]
        else:
            data["moe"] = self.moe.to_dict()
        for name in ("split_blocker", "width_norms", "sp_blocker"):
            if not data["tp"][name]:
                del data["tp"][name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerProfile:
        """Inverse of ``to_dict``."""
        data = dict(data)
        tp = data.pop("tp", {}) or {}
        tp_fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in tp.items()
        }
        tp = TPStructure(**tp_fields)
        data["module_fqns"] = tuple(data["module_fqns"])
        for name in ("linear_saved_bytes", "linear_shared_bytes", "norm_saved_bytes",
                     "combine_saved_bytes", "weight_pass_grad_bytes", "input_pass_freed_bytes"):
            if name in data:
                data[name] = tuple(data[name])
        op_sac = data.pop("op_sac", None)
        moe = data.pop("moe", None)
        return cls(tp=tp, op_sac=OpSacCounts(**op_sac) if op_sac else None,
                   moe=MoEStructure(**moe) if moe else None, **data)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelProfile:
    """What the cost model needs to know about a model, layer by layer.

    Attributes:
        name: model name (zoo preset, "gpt", file name, HF model_type).
        layers: the layers in execution order: embedding, blocks, head.
        seq_len: tokens per sample the counts are for.
        dtype: dtype the byte counts are at ("bf16", "fp16", "fp32").
        hidden: model width h.
        heads: attention heads a.
        kv_heads: key/value heads (== heads without GQA).
        ffn_hidden: MLP inner width.
        vocab: vocabulary size V.
        num_blocks: transformer blocks L.
        attention: "sdpa" (costed as the fused kernel) or "eager" (s x s scores kept).
        trace_method: how the structure was captured: "fx", "export" or "modules".
        tied_embeddings: whether the lm head shares the token embedding's weight.
        loss: the token cross entropy's kernel the profile ran: "eager" (fp32 log-probabilities
            kept) or "fused" (logits and a log-sum-exp kept, gradient in place).
        cp_blocker: why autopar's runtime cannot shard the traced model's sequences over cp
            ("" when it can: the zoo's attention, a Hugging Face decoder's through transformers'
            attention interface with rotary positions, sliding windows too;
            ``graph.cp.cp_blocker``; written to JSON
            only when set, so those profiles keep their fingerprints). Which experts it shards
            over ep is each layer's ``MoEStructure.ep_blocker``.
        own_loss: the model trains with its own loss (a model file's ``loss_fn``, or the one
            given to ``profile``), which autopar's runtime gives whole logits under tp instead
            of running its vocab-parallel loss (in JSON only when set).
        pp_blocker: why autopar's runtime cannot pipeline the model ("" when it can: its
            inputs are token ids and its loss the runtime's; ``graph.inputs.pipeline_blocker``;
            in JSON only when set).
    """

    name: str
    layers: tuple[LayerProfile, ...]
    seq_len: int
    dtype: str
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    num_blocks: int
    attention: str = "sdpa"
    trace_method: str = "fx"
    tied_embeddings: bool = False
    loss: str = "eager"
    cp_blocker: str = ""
    own_loss: bool = False
    pp_blocker: str = ""

    @property
    def num_params(self) -> int:
        """Total parameters (tied weights once)."""
        return sum(layer.num_params for layer in self.layers)

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return any(layer.moe is not None for layer in self.layers)

    @property
    def num_layers(self) -> int:
        """Number of pipeline-placeable layers (len(layers))."""
        return len(self.layers)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the profile."""
        data = dataclasses.asdict(self)
        data["layers"] = [layer.to_dict() for layer in self.layers]
        if not self.cp_blocker:
            del data["cp_blocker"]
        if not self.own_loss:
            del data["own_loss"]
        if not self.pp_blocker:
            del data["pp_blocker"]
        return data

    def to_json(self) -> str:
        """Canonical JSON (sorted keys), so equal profiles give equal text."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        """Inverse of ``to_dict``."""
        data = dict(data)
        layers = tuple(LayerProfile.from_dict(d) for d in data.pop("layers"))
        if data.pop("zoo_modules", True) is False and "cp_blocker" not in data:
            # Written before profiles said why: such a model ran context parallelism nowhere.
            data["cp_blocker"] = "the profile predates autopar's record of it; profile again"
        return cls(layers=layers, **data)

    def fingerprint(self) -> str:
        """A short stable hash of everything in the profile (sha256 of the canonical JSON)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]
