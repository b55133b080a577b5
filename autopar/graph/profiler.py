"""``profile(model)``: a ModelProfile of any PyTorch model, measured on the meta device.

Steps: copy the model onto the meta device at the profile dtype (the caller's model is left
untouched); find the repeated blocks; trace the module order (fx, else the module hooks of the run
below); run the model with the blocks relayed to measure the embedding and the head, then each
distinct block alone; do both at batch 1 and 2 and keep the difference (per sample). Routed
experts of mixture-of-experts layers run as a value-independent stand-in (``graph/moe.py``).
Counts are per sample of ``seq_len`` tokens (see ``autopar.graph.types``).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import itertools
import numbers
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.config import MAX_SEQ_LEN
from autopar.errors import AutoparError, TraceError
from autopar.graph.cp import cp_blocker
from autopar.graph.facts import ModelFacts, default_seq_len, learned_positions, model_facts
from autopar.graph.inputs import (
    Batch,
    compute_loss,
    logit_positions_short,
    make_batch,
    pipeline_blocker,
    seq_len_of,
)
from autopar.graph.layers import build_layers, per_sample
from autopar.graph.measure import (
    Measured,
    ModelRun,
    RunFailure,
    main_tensor,
    measure_block,
    run_model,
)
from autopar.graph.moe import install_expert_standins
from autopar.graph.recorder import SavedRecorder
from autopar.graph.structure import find_blocks, group_outside, module_signature
from autopar.graph.tp import block_tp
from autopar.graph.trace import CallOrder, trace_call_order
from autopar.graph.types import ModelProfile
from autopar.models.losses import LOSS_KERNELS
from autopar.models.zoo import TORCH_DTYPES, torch_dtype

__all__ = ["KERNELS", "profile", "short_logits_refused"]

# Whether a forward returning logits for too few positions is an error (``autopar run``: its
# LM default loss needs them all) rather than a warning (planning: the profile is still useful).
_SHORT_LOGITS_FATAL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "short_logits_fatal", default=False)


@contextlib.contextmanager
def short_logits_refused() -> Iterator[None]:
    """Within it, ``profile`` refuses (AutoparError) a forward whose logits cover fewer
    positions than the sequence when the model has no loss of its own (``loss_fn``), which it
    otherwise notes on stderr."""
    token = _SHORT_LOGITS_FATAL.set(True)
    try:
        yield
    finally:
        _SHORT_LOGITS_FATAL.reset(token)

# Kernel sets whose saved tensors ``profile`` can count (see its ``kernels`` argument).
KERNELS = ("cuda", "cpu")

_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
_BATCH_SIZES = (1, 2)  # per-sample counts = counts(b=2) - counts(b=1)


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    try:
        return torch_dtype(dtype)  # the zoo's rule
    except ValueError as err:
        raise AutoparError(str(err)) from None


def _meta_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A structural copy of ``model`` on the meta device at ``dtype``, in train mode.

    Every module is copied shallowly with its own parameter, buffer, child and hook dicts, the
    parameters and buffers replaced by empty meta tensors (no memory), tied weights kept tied. The
    caller's model is not touched (the profile sets hooks and train mode on the copy only).
    """
    tensors: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) not in tensors:
            target = dtype if tensor.is_floating_point() else tensor.dtype
            data = torch.empty(tensor.shape, dtype=target, device="meta")
            if isinstance(tensor, nn.Parameter):
                data = nn.Parameter(data, requires_grad=tensor.requires_grad)
            tensors[id(tensor)] = data
    copies: dict[int, nn.Module] = {}

    def clone(module: nn.Module) -> nn.Module:
        if id(module) in copies:
            return copies[id(module)]
        new = copy.copy(module)
        copies[id(module)] = new
        state = new.__dict__
        for key, value in vars(module).items():
            if isinstance(value, dict) and key.startswith("_"):
                state[key] = type(value)(value)  # own hook / registry dicts
        state["_parameters"] = {
            k: tensors[id(v)] if v is not None else None for k, v in module._parameters.items()
        }
        state["_buffers"] = {
            k: tensors[id(v)] if v is not None else None for k, v in module._buffers.items()
        }
        state["_modules"] = {
            k: clone(v) if v is not None else None for k, v in module._modules.items()
        }
        state["training"] = True
        return new

    return clone(model)


def _vocab_modules(model: nn.Module, blocks: Sequence[str], vocab: int) -> tuple[list, list]:
    # Outside the blocks: token embeddings (vocab rows) and lm heads (vocab outputs).
    embeddings, heads = [], []
    inside = {id(m) for b in blocks for m in model.get_submodule(b).modules()}
    for module in model.modules():
        if id(module) in inside or not vocab:
            continue
        if isinstance(module, nn.Embedding) and module.num_embeddings == vocab:
            embeddings.append(module)
        elif isinstance(module, nn.Linear) and module.out_features == vocab:
            heads.append(module)
    return embeddings, heads


def _recorder(
    model: nn.Module, sharded: Sequence[torch.Tensor], fake_mode: FakeTensorMode | None,
    fused_rms_norm: bool,
) -> SavedRecorder:
    # Parameters and buffers are meta tensors; inside a fake mode ops see their fake versions
    # (memoized by the mode while alive, so converting them here gives the tensors ops use).
    def both(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if fake_mode is None:
            return list(tensors)
        return [*tensors, *(fake_mode.from_tensor(t) for t in tensors)]

    return SavedRecorder(both([*model.parameters(), *model.buffers()]), both(sharded),
                         fused_rms_norm=fused_rms_norm)


def _run_all(
    work: nn.Module,
    batches: dict[int, Batch],
    blocks: Sequence[str],
    vocab: int,
    loss_fn: Callable[..., Any] | None,
    fake_mode: FakeTensorMode | None,
    fused_rms_norm: bool,
    short: list[int],
    loss: str = "eager",
) -> dict[int, ModelRun]:
    """Run the model at every batch size; append to ``short`` the logit positions of a run
    whose logits cover fewer positions than its tokens (``logit_positions_short``)."""
    signatures = {b: module_signature(work.get_submodule(b)) for b in blocks}
    embeddings, heads = _vocab_modules(work, blocks, vocab)
    sharded = [p for m in (*embeddings, *heads) for p in m.parameters()]
    runs = {}
    for size, batch in batches.items():

        def forward_and_loss(batch: Batch = batch) -> torch.Tensor:
            output = work(*batch.args, **batch.kwargs)
            positions = logit_positions_short(output, batch, vocab)
            if positions is not None:
                short.append(positions)
            return compute_loss(output, batch, vocab, loss_fn, loss)

        tokens = batch.args[0] if batch.args else None
        runs[size] = run_model(
            work,
            forward_and_loss,
            blocks=blocks,
            signatures=signatures,
            recorder=_recorder(work, sharded, fake_mode, fused_rms_norm),
            fake_mode=fake_mode,
            reduce_modules=embeddings,
            input_bytes=tokens.numel() * tokens.element_size()
            if isinstance(tokens, torch.Tensor)
            else 0,
        )
    return runs


def _measure_blocks(
    work: nn.Module,
    blocks: Sequence[str],
    runs: dict[int, ModelRun],
    fake_mode: FakeTensorMode | None,
    fused_rms_norm: bool,
) -> tuple[dict[str, str], dict[str, Measured]]:
    """Measure each distinct block once per batch size; return (block -> representative, counts)."""
    representative: dict[str, str] = {}
    first_of_key: dict[tuple, str] = {}
    measured: dict[str, Measured] = {}
    for fqn in blocks:
        key = runs[1].block_keys[fqn]
        rep = first_of_key.setdefault(key, fqn)
        representative[fqn] = rep
        if rep != fqn:
            continue
        block = work.get_submodule(fqn)
        params, reduce = _block_sharding(work, fqn)
        counts = {}
        for size, run in runs.items():
            call = run.calls[run.block_keys[fqn]]
            recorder = _recorder(work, params, fake_mode, fused_rms_norm)
            counts[size] = measure_block(block, call, recorder, reduce, fake_mode)
        measured[fqn] = per_sample(counts[1], counts[2])
    return representative, measured


def _block_sharding(work: nn.Module, fqn: str) -> tuple[list[torch.Tensor], list[nn.Module]]:
    """Parameters tp shards in block ``fqn`` (colwise weights and biases, rowwise weights), and
    the row-parallel linears (where the all-reduce makes activations replicated again)."""
    tp = block_tp(work, fqn, heads=0, kv_heads=0, seq_len=1, dtype_bytes=1)
    colwise = [work.get_submodule(n) for n in tp.colwise]
    rowwise = [work.get_submodule(n) for n in tp.rowwise]
    params: list[torch.Tensor] = [p for m in colwise for p in m.parameters()]
    params += [cast(torch.Tensor, m.weight) for m in rowwise]
    return params, rowwise


def _trace_error(work: nn.Module, failure: RunFailure, trace: CallOrder, name: str) -> TraceError:
    module = failure.module or "<root>"
    kind = type(work.get_submodule(failure.module)).__name__ if failure.module else "model"
    err = failure.error
    first = (str(err).strip().splitlines() or [""])[0][:200]
    tried = "; ".join(trace.failures)
    return TraceError(
        f"cannot profile {name}: module {module!r} ({kind}) fails on meta tensors with "
        f"{type(err).__name__}: {first} [{tried}]; make its forward depend only on tensor "
        "shapes, not values (no .item(), .tolist() or Python `if` on a tensor), or move that "
        "computation out of forward"
    )


def _run_with_fallback(
    work: nn.Module,
    batches: dict[int, Batch],
    blocks: Sequence[str],
    loss_fn: Callable[..., Any] | None,
    trace: CallOrder,
    fused_rms_norm: bool,
    loss: str = "eager",
) -> tuple[dict[int, ModelRun], FakeTensorMode | None]:
    """Run on plain meta tensors; if the model fails there, on fake tensors; else TraceError.

    A forward that returns logits for one position of many is said on stderr, once.
    """
    prelim = model_facts(work, hidden_seen=0, heads_seen=0, kv_heads_seen=0, block=None)
    short: list[int] = []
    tokens = batches[1].labels.shape[1] if batches[1].labels is not None else 0
    try:
        runs = _run_all(work, batches, blocks, prelim.vocab, loss_fn, None, fused_rms_norm,
                        short, loss)
        if short:
            _warn_short_logits(prelim.name, short[0], int(tokens), own_loss=loss_fn is not None)
        return runs, None
    except RunFailure as on_meta:
        # Plain meta tensors fail on value tests (HF checks for packed sequences); fake tensors
        # make such models skip them. Slower, so only when needed. The meta failure is the
        # clearer message when both fail.
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        try:
            runs = _run_all(work, batches, blocks, prelim.vocab, loss_fn, fake_mode,
                            fused_rms_norm, short, loss)
            if short:
                _warn_short_logits(prelim.name, short[0], int(tokens), own_loss=loss_fn is not None)
            return runs, fake_mode
        except RunFailure:
            raise _trace_error(work, on_meta, trace, prelim.name) from on_meta.error


def _check_seq_len(seq_len: Any) -> None:
    """None (the model's own) or a whole number of tokens in [1, MAX_SEQ_LEN]."""
    if seq_len is not None and (isinstance(seq_len, bool)
                                or not isinstance(seq_len, numbers.Integral)
                                or not 1 <= int(seq_len) <= MAX_SEQ_LEN):
        raise AutoparError(f"profile seq_len must be a whole number from 1 to {MAX_SEQ_LEN:,}, "
                           f"got {seq_len!r}")


def profile(
    model: nn.Module,
    seq_len: int | None = None,
    example_inputs: Any = None,
    dtype: torch.dtype | str = torch.bfloat16,
    *,
    loss_fn: Callable[..., Any] | None = None,
    kernels: str = "cuda",
    loss: str = "eager",
) -> ModelProfile:
    """Profile ``model`` layer by layer on the meta device, per sample of ``seq_len`` tokens.

    Args:
        model: any ``nn.Module`` (zoo, HF, or a model file's ``build_model()``); real or meta
            parameters: it is copied onto the meta device and left unchanged.
        seq_len: tokens per sample; default the zoo spec's, the HF context (capped at 4096), or
            the example inputs' dim 1.
        example_inputs: None (token ids ``[b, seq_len]``), ``example_inputs(batch_size)``, or a
            batch (tensor, tuple or dict) re-sized along dim 0.
        dtype: the dtype counts are at (bf16 default; also fp16, fp32 or their short names).
        loss_fn: ``loss_fn(output, batch)``; default token cross entropy on fp32 logits.
        kernels: whose kernels' saved tensors to count: "cuda" (default; fused RMSNorm,
            flash attention, bool dropout masks) or "cpu" (the same, but RMSNorm as torch's
            CPU composite, which also keeps x * 1/rms: one [b, s, h] more per norm).
        loss: the token cross entropy's kernel (without ``loss_fn``): "eager" (torch's on fp32
            logits: keeps the fp32 log-probabilities) or "fused" (a fused kernel such as
            flash-attn's, llm-foundry's default: keeps the logits and a log-sum-exp per token,
            its gradient written in place; ``autopar.models.losses``).

    Returns:
        The ModelProfile.

    Raises:
        TraceError: the model cannot run on meta tensors (names the module and the construct).
        AutoparError: no sequence length is known, an unsupported dtype, or no parameter
            to train.

    Example:
        >>> model = autopar.models.build("gpt", layers=2, hidden=64, heads=4, vocab=256,
        ...                              seq_len=32)
        >>> autopar.profile(model).layers[1].fwd_flops   # 24 s h^2 + 4 s^2 h
    """
    torch_dtype = _resolve_dtype(dtype)
    _check_seq_len(seq_len)
    _check_trainable(model, loss, loss_fn)
    if seq_len is None:
        seq_len = (
            seq_len_of(example_inputs) if example_inputs is not None else default_seq_len(model)
        )
    if not seq_len:
        raise AutoparError("profile needs seq_len: pass seq_len=... (tokens per sample)")
    positions = learned_positions(model)
    if positions is not None and int(seq_len) > positions[1]:
        raise AutoparError(
            f"sequence length {int(seq_len):,} is beyond the {positions[1]:,} positions of the "
            f"model's learned position embedding ({positions[0]}); use a sequence length "
            f"(--seq-len) of at most {positions[1]:,}")
    return _profile_meta(_meta_copy(model, torch_dtype), int(seq_len), torch_dtype,
                         example_inputs, loss_fn, kernels, loss)


def _check_trainable(model: nn.Module, loss: str, loss_fn: Callable[..., Any] | None) -> None:
    """Something to train, and a loss kernel the profiler knows."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"profile() takes a torch nn.Module (autopar.models.build(...)), got "
                        f"{type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise AutoparError(
            f"{type(model).__name__} has no trainable parameters (none, or none that requires "
            "grad); autopar plans training: give a model with parameters to train")
    if loss not in LOSS_KERNELS or (loss != "eager" and loss_fn is not None):
        raise AutoparError(f"profile loss must be one of {LOSS_KERNELS} (and 'eager' with a "
                           f"loss_fn), got {loss!r}")


def _profile_meta(work: nn.Module, seq_len: int, torch_dtype: torch.dtype, example_inputs: Any,
                  loss_fn: Callable[..., Any] | None, kernels: str,
                  loss: str = "eager") -> ModelProfile:
    """``profile`` of the model's meta copy ``work``."""
    install_expert_standins(work)  # routed experts by formula (graph/moe.py), like SDPA
    container, blocks = find_blocks(work)
    batches = {b: make_batch(work, b, seq_len, example_inputs, torch_dtype) for b in _BATCH_SIZES}
    trace = trace_call_order(work, blocks)
    if kernels not in KERNELS:
        raise AutoparError(f"profile kernels must be one of {KERNELS}, got {kernels!r}")
    fused = kernels == "cuda"
    runs, fake_mode = _run_with_fallback(work, batches, blocks, loss_fn, trace, fused, loss)
    order = trace.order if trace.method else runs[1].call_order
    structure = group_outside(container, blocks, order)
    representative, measured = _measure_blocks(work, blocks, runs, fake_mode, fused)
    facts = _facts(work, blocks, measured, runs[1])
    layers, shared = _shared_weights(work, build_layers(
        work, structure=structure, facts=facts, runs=runs, representative=representative,
        measured=measured, seq_len=seq_len, dtype=torch_dtype))
    return ModelProfile(
        name=facts.name, layers=layers, seq_len=seq_len, dtype=_DTYPE_NAMES[torch_dtype],
        hidden=facts.hidden, heads=facts.heads, kv_heads=facts.kv_heads,
        ffn_hidden=facts.ffn_hidden, vocab=facts.vocab, num_blocks=len(blocks),
        attention=facts.attention, trace_method=trace.method or "modules",
        tied_embeddings=_tied(work, structure.embedding, structure.head), loss=loss,
        cp_blocker=cp_blocker(work), own_loss=loss_fn is not None,
        pp_blocker=pipeline_blocker(example_inputs, loss_fn) or shared,
    )


def _warn_short_logits(name: str, positions: int, seq_len: int, *, own_loss: bool) -> None:
    """One stderr line: the profiled forward computed logits for too few positions (an error
    within ``short_logits_refused`` for a model trained on the LM loss of its logits)."""
    text = (f"{name}'s forward returned logits for {positions} of {seq_len} positions (a "
            "nanoGPT-style forward given no targets keeps only the last), so the profile misses "
            "the output layer and the loss on the others; make example_inputs(batch_size) "
            "return (idx, targets) so forward computes every position, and loss_fn(output, "
            "batch) return the model's own loss")
    if _SHORT_LOGITS_FATAL.get() and not own_loss:
        raise AutoparError(text.replace("so the profile misses", "so training misses"))
    print(f"autopar: warning: {text}", file=sys.stderr)


def _facts(
    work: nn.Module, blocks: Sequence[str], measured: dict[str, Measured], run: ModelRun
) -> ModelFacts:
    first = measured.get(blocks[0]) if blocks else None
    calls = first.attention if first is not None else ()
    block = work.get_submodule(blocks[0]) if blocks else None
    hidden_seen = 0
    if blocks:
        call = run.calls[run.block_keys[blocks[0]]]
        main = main_tensor((call.args, call.kwargs))
        hidden_seen = int(main.shape[-1]) if main is not None and main.dim() else 0
    return model_facts(
        work,
        hidden_seen=hidden_seen,
        heads_seen=calls[0].heads if calls else 0,
        kv_heads_seen=calls[0].kv_heads if calls else 0,
        block=block,
    )


def _tied(work: nn.Module, embedding: Sequence[str], head: Sequence[str]) -> bool:
    emb = {id(p) for f in embedding for p in work.get_submodule(f).parameters()}
    return any(id(p) in emb for f in head for p in work.get_submodule(f).parameters())


def _shared_weights(work: nn.Module, layers: tuple) -> tuple[tuple, str]:
    """(the layers, why pp cannot cut the model: ""): a weight shared by two modules other than
    the token embedding and the lm head (one block's with another's), which autopar's runtime
    splits over neither pp nor tp (``runtime/tied_weights.check_tied_split``), so the layers
    that hold it say so in their ``TPStructure.split_blocker`` too."""
    owners: dict[int, list[tuple[str, int]]] = {}
    for index, layer in enumerate(layers):
        for fqn in layer.module_fqns:
            for name, param in work.get_submodule(fqn).named_parameters():
                owners.setdefault(id(param), []).append((f"{fqn}.{name}", index))
    for found in owners.values():
        held = sorted({index for _f, index in found})
        kinds = {layers[index].kind for index in held}
        if len(held) > 1 and kinds != {"embedding", "head"}:
            why = (f"it shares {found[1][0]} with {found[0][0]} (one weight), and autopar's "
                   "runtime splits a weight shared only by the token embedding and the lm head")
            return tuple(dataclasses.replace(x, tp=dataclasses.replace(x.tp, split_blocker=why))
                         if i in held and not x.tp.split_blocker else x
                         for i, x in enumerate(layers)), why
    return layers, ""
