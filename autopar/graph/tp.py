"""Tensor-parallel structure of a layer, by the names of its linears (Megatron's split).

In a block, the linears that open a sharded region are column-parallel (q/k/v projections, the
MLP's up and gate projections) and those that close it row-parallel (attention output, MLP down
projection); norms run sequence-parallel. The token embedding and the lm head shard over the
vocabulary. Names known: the zoo's (``wq wk wv wo w1 w2 w3``), HF Llama-family (``q_proj k_proj
v_proj o_proj gate_proj up_proj down_proj``) and a few common ones (``fc1/fc2``, ``query/key/value``
with ``out_proj``), GPT-2 / nanoGPT's (``c_fc`` colwise, ``c_proj`` rowwise). ``nn.Linear`` and HF's
``Conv1D`` (GPT-2's transposed linear, weight ``[in, out]``) qualify. A fused q/k/v projection
(``c_attn``, ``qkv_proj``, ``Wqkv``, ``query_key_value``: one matrix computing q, k and v of equal
width) is column-parallel too and is also listed as ``fused``: a plain column split would hand one
rank all of q and part of k, so the runtime splits each of q, k and v over the ranks and keeps a
rank's heads of the three together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from torch import Tensor, nn

from autopar.graph.types import TPStructure
from autopar.models.tp_names import COLWISE_NAMES, FUSED_QKV_NAMES, ROWWISE_NAMES

__all__ = [
    "COLWISE_NAMES",
    "ROWWISE_NAMES",
    "block_tp",
    "embedding_tp",
    "head_tp",
    "is_linear",
    "is_norm",
    "out_features",
    "per_head_norms",
    "per_head_params",
    "split_blocker",
    "width_norms",
]

def is_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` or HF's ``Conv1D`` (weight ``[in, out]``)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def out_features(module: nn.Module) -> int:
    """Output width of a linear (``nn.Linear.out_features``, ``Conv1D.nf``)."""
    return int(getattr(module, "out_features", None) or cast(Tensor, module.weight).shape[-1])


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a LayerNorm / RMSNorm (torch's or a model's own, by class name)."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    name = type(module).__name__.lower()
    return name.endswith(("layernorm", "rmsnorm"))


def _named(model: nn.Module, fqns: Sequence[str]) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    for root in fqns:
        for name, module in model.get_submodule(root).named_modules():
            found.append((f"{root}.{name}" if name else root, module))
    return found


def block_tp(
    model: nn.Module, fqn: str, *, heads: int, kv_heads: int, seq_len: int, dtype_bytes: int
) -> TPStructure:
    """TP structure of block ``fqn``: colwise/rowwise linears by name, norms, all-reduce bytes.

    A block with no column- or no row-parallel linear gets an empty structure (replicated).
    ``allreduce_fwd_bytes`` is one all-reduce of each row-parallel output per sample,
    ``s * out_features * bytes``: ``2 s h bytes`` for a transformer block (Megatron-LM SC'21).

    Args:
        model: the model.
        fqn: the block's FQN.
        heads: attention heads of the block.
        kv_heads: key/value heads.
        seq_len: tokens per sample.
        dtype_bytes: bytes per element of the activations.

    Returns:
        The TPStructure.
    """
    colwise, rowwise, sequence, fused = [], [], [], []
    widths: dict[str, int] = {}
    for name, module in _named(model, [fqn]):
        leaf = name.rpartition(".")[2]
        if is_linear(module) and leaf in FUSED_QKV_NAMES and out_features(module) % 3 == 0:
            colwise.append(name)
            fused.append(name)
        elif is_linear(module) and leaf in COLWISE_NAMES:
            colwise.append(name)
        elif is_linear(module) and leaf in ROWWISE_NAMES:
            rowwise.append(name)
            widths[name] = out_features(module)
        elif is_norm(module):
            sequence.append(name)
    # A region opens and closes in one module (attention: q/k/v and o; MLP: up/gate and down):
    # a row-parallel linear whose module splits no input projection (GLM-4's and Phi-3's fused
    # gate_up_proj, which no name marks) would read a full-width input, so both stay whole.
    opened = {_parent(n) for n in colwise} & {_parent(n) for n in rowwise}
    colwise = [n for n in colwise if _parent(n) in opened]
    fused = [n for n in fused if _parent(n) in opened]
    rowwise = [n for n in rowwise if _parent(n) in opened]
    allreduce = sum(seq_len * widths[n] * dtype_bytes for n in rowwise)
    if not colwise or not rowwise:
        return TPStructure(heads=heads, kv_heads=kv_heads)
    sequence, width = _sequence_and_width_norms(model, sequence, opened)
    tensors, elements = _norm_params(model, sequence)
    return TPStructure(
        colwise=tuple(colwise),
        rowwise=tuple(rowwise),
        sequence=tuple(sequence),
        fused_qkv=tuple(fused),
        heads=heads,
        kv_heads=kv_heads,
        allreduce_fwd_bytes=allreduce,
        sequence_param_tensors=tensors,
        sequence_param_elements=elements,
        split_blocker=(split_blocker(model, {_parent(n) for n in colwise})
                       or _fused_blocker(model, fused, colwise, rowwise, heads, kv_heads)),
        width_norms=tuple(width),
    )


def _fused_blocker(model: nn.Module, fused: list[str], colwise: list[str],
                   rowwise: list[str], heads: int, kv_heads: int) -> str:
    """Why the block's fused q/k/v attention cannot run on one tp rank's share of it ("": it can,
    or none is fused): the runtime's own check (``runtime/tp_checks.py``) at the smallest tp
    that splits its heads."""
    from autopar.graph.fused_attention import local_attention_error

    tp = next((d for d in range(2, max(heads, 1) + 1)
               if heads % d == 0 and kv_heads % d == 0), None)
    if not fused or tp is None:
        return ""
    parent = _parent(fused[0])
    styles = {n.removeprefix(parent + "."): "colwise_qkv" if n in fused else "colwise"
              for n in colwise if _parent(n) == parent}
    styles |= {n.removeprefix(parent + "."): "rowwise" for n in rowwise if _parent(n) == parent}
    error = local_attention_error(model.get_submodule(parent), styles, tp)
    if error is None:
        return ""
    # The failure's kind only: the profile's fingerprint must not follow the wording of torch's
    # or the model's messages from one version to the next (the runtime's check shows them).
    kind = error.split(":")[0] if ":" in error else "a wrong output shape"
    return (f"its attention {parent} does not run on one rank's share of the fused q/k/v "
            f"{fused[0]} ({kind}); it must size its views by its width and head attributes "
            "(split_size or n_embd, n_head or num_heads) or by -1")


def _sequence_and_width_norms(model: nn.Module, norms: list[str], parents: Iterable[str]
                              ) -> tuple[list[str], list[str]]:
    """(the sequence-parallel norms, the norms over a split linear's whole output): those are
    split with the features (``width_norms``), not sequence-parallel."""
    width = sorted(f"{p}.{n}" for p in parents for n in width_norms(model.get_submodule(p)))
    return [n for n in norms if n not in width], width


def split_blocker(model: nn.Module, parents: Iterable[str]) -> str:
    """Why splitting the traced modules ``parents`` (those whose linears tensor parallelism
    splits column-wise) over the heads would be wrong, or "": a norm with weights inside one
    that is neither per head nor over a split linear's whole output, or a parameter one holds
    beside its linears that is not one value per head. A per-head norm (``per_head_norms``:
    Qwen3's and Gemma 3's ``q_norm`` and ``k_norm``), a norm over a split output
    (``width_norms``: OLMo 2's) and a per-head parameter (``per_head_params``: gpt-oss's
    attention ``sinks``) split with the heads."""
    for parent in sorted(parents):
        module = model.get_submodule(parent)
        head = set(per_head_params(module))
        own = [name for name, _ in module.named_parameters(recurse=False) if name not in head]
        if own:
            return (f"{parent} holds its own parameter {own[0]!r} beside the linears tensor "
                    "parallelism splits (one value per head would meet 1/tp of the heads)")
        split = set(per_head_norms(module)) | set(width_norms(module))
        for name, inner in module.named_modules():
            if name and is_norm(inner) and list(inner.parameters()) and name not in split:
                return (f"the norm {parent}.{name} sits inside the split module {parent} and "
                        "normalises across heads, which would see 1/tp of them")
    return ""


def per_head_norms(parent: nn.Module) -> list[str]:
    """Names (relative to ``parent``, a module whose linears are split over the heads) of the
    norms inside it that normalise each head alone: their weights are ``head_dim`` wide
    (``parent.head_dim``). Each rank runs them on its own heads; only their weight gradient,
    a sum over every head, needs the other ranks' share (runtime/tensor_parallel.py)."""
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return []
    return [name for name, inner in parent.named_modules()
            if name and is_norm(inner) and list(inner.parameters())
            and all(p.numel() == head_dim for p in inner.parameters())]


def per_head_params(parent: nn.Module) -> list[str]:
    """Names of the parameters a split module holds itself, one value per attention head
    (gpt-oss's ``sinks``): 1-D, as long as a split linear's output over ``parent.head_dim``.
    Each rank holds its heads' values (runtime/tp_styles.py ``shard_head_params``)."""
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return []
    heads = {m.out_features // head_dim for _n, m in parent.named_modules()
             if isinstance(m, nn.Linear) and m.out_features % head_dim == 0}
    return [name for name, p in parent.named_parameters(recurse=False)
            if p.dim() == 1 and p.numel() in heads]


def width_norms(parent: nn.Module) -> list[str]:
    """Names (relative to ``parent``, a module whose linears are split over the heads) of the
    norms inside it that normalise a linear's whole output, all heads together (OLMo 2's
    ``q_norm`` and ``k_norm``): every parameter as wide as the output of one of its linears and
    not ``head_dim`` wide. Each rank holds the slice of their weights for its heads; their
    statistics are summed over the tp ranks (runtime/tp_styles.py ``WidthNorm``)."""
    widths = {m.out_features for _n, m in parent.named_modules() if isinstance(m, nn.Linear)}
    head = set(per_head_norms(parent))
    return [name for name, inner in parent.named_modules()
            if name and name not in head and is_norm(inner) and list(inner.parameters())
            and all(p.dim() == 1 and p.numel() in widths for p in inner.parameters())]


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _norm_params(model: nn.Module, fqns: Sequence[str]) -> tuple[int, int]:
    """(parameter tensors, elements) directly owned by the norms ``fqns``."""
    params = [p for f in fqns for p in model.get_submodule(f).parameters(recurse=False)]
    return len(params), sum(p.numel() for p in params)


def embedding_tp(
    model: nn.Module, fqns: Sequence[str], *, vocab: int, seq_len: int, dtype_bytes: int
) -> TPStructure:
    """The embedding layer: the token embedding (``vocab`` rows) is vocabulary-parallel.

    Its output is all-reduced over tp: ``s * h * bytes`` per sample.
    """
    vocab_parallel, allreduce, norms = [], 0, []
    for name, module in _named(model, fqns):
        if isinstance(module, nn.Embedding) and vocab and module.num_embeddings == vocab:
            vocab_parallel.append(name)
            allreduce += seq_len * module.embedding_dim * dtype_bytes
        elif is_norm(module):
            norms.append(name)
    # autopar's runtime shards no norm before the blocks over the sequence (its layout has
    # none; BLOOM's word_embeddings_layernorm, were it sharded, meets a model that builds its
    # own shapes from the whole sequence).
    blocker = (f"a norm after the token embedding ({norms[0]}) runs on the whole sequence"
               if norms else "")
    return TPStructure(vocab_parallel=tuple(vocab_parallel), allreduce_fwd_bytes=allreduce,
                       sp_blocker=blocker)


def head_tp(model: nn.Module, fqns: Sequence[str], *, vocab: int) -> TPStructure:
    """The head: the final norm runs sequence-parallel, the lm head (``vocab`` outputs) is
    vocabulary-parallel (its logits stay sharded into a vocab-parallel loss)."""
    vocab_parallel, sequence = [], []
    for name, module in _named(model, fqns):
        if isinstance(module, nn.Linear) and vocab and module.out_features == vocab:
            vocab_parallel.append(name)
        elif is_norm(module):
            sequence.append(name)
    tensors, elements = _norm_params(model, sequence)
    return TPStructure(vocab_parallel=tuple(vocab_parallel), sequence=tuple(sequence),
                       sequence_param_tensors=tensors, sequence_param_elements=elements)
