"""Measure FLOPs and saved bytes of the layers on meta tensors, forward and backward.

Two kinds of run, each at one batch size (``profile`` runs both at b = 1 and b = 2 and takes the
difference, so what does not grow with the batch, such as a causal mask built in forward, drops
out of the per-sample counts):

- ``run_model``: the whole model with every block replaced by a *relay* (an autograd function that
  returns an output of the block's shape and passes a gradient of the input's shape back). Each
  distinct block (structure + input shapes) is run once for real under ``no_grad`` to learn its
  output, and its inputs are kept. FLOPs and saved tensors before the first block are the
  embedding layer's, after the last block the head's (loss included). Module hooks record the
  order of first calls and, if the model fails on meta tensors, the module that failed.
- ``measure_block``: one block on its recorded inputs, alone.

Instruments: ``torch.utils.flop_counter.FlopCounterMode`` (matmul FLOPs), ``saved_tensors_hooks``
with ``SavedRecorder`` (storages de-duplicated, parameters excluded), ``GpuKernelMode`` (SDPA
as the fused kernel, FLOPs by formula: backward = 2x forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from autopar.graph.gpu_kernels import AttentionCall, GpuKernelMode
from autopar.graph.recorder import SavedRecorder, SavedTotals
from autopar.graph.tp import is_norm
from autopar.graph.trace import quiet

__all__ = [
    "BlockCall",
    "Measured",
    "ModelRun",
    "RunFailure",
    "main_tensor",
    "measure_block",
    "run_model",
]


class RunFailure(Exception):
    """The model raised while running on meta tensors; ``module`` is the innermost one running."""

    def __init__(self, module: str, error: BaseException) -> None:
        super().__init__(f"{module or '<root>'}: {error}")
        self.module = module
        self.error = error


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """One layer's counts at one batch size."""

    fwd_flops: int
    bwd_flops: int
    core_fwd_flops: int
    saved: SavedTotals
    input_bytes: int
    output_bytes: int
    attention: tuple[AttentionCall, ...] = ()
    op_sac_recompute_flops: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockCall:
    """The recorded call of a distinct block: inputs (meta), which of them need grad, output."""

    args: tuple
    kwargs: dict[str, Any]
    requires_grad: tuple[bool, ...]
    output: Any


@dataclass(slots=True, kw_only=True)
class ModelRun:
    """What ``run_model`` learned."""

    embedding: Measured
    head: Measured | None
    call_order: tuple[str, ...]
    block_keys: dict[str, tuple] = field(default_factory=dict)
    calls: dict[tuple, BlockCall] = field(default_factory=dict)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def main_tensor(value: Any) -> torch.Tensor | None:
    """The first floating tensor in a pytree (the hidden states), else its first tensor."""
    leaves = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    floats = [t for t in leaves if t.is_floating_point()]
    return floats[0] if floats else (leaves[0] if leaves else None)


def _signature(value: Any) -> tuple:
    leaves, spec = tree_flatten(value)
    parts = tuple(
        (tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else repr(t)
        for t in leaves
    )
    return (str(spec), parts)


class _Relay(torch.autograd.Function):
    """Stands in for a block: output of the block's shape, input-shaped gradient back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, template: torch.Tensor, on_bwd: Callable) -> Any:
        ctx.in_shape, ctx.in_dtype, ctx.on_bwd = x.shape, x.dtype, on_bwd
        return template.new_empty(template.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.on_bwd()
        return grad.new_empty(ctx.in_shape, dtype=ctx.in_dtype), None, None


@contextlib.contextmanager
def _instruments(
    recorder: SavedRecorder, fake_mode: FakeTensorMode | None
) -> Iterator[tuple[FlopCounterMode, list]]:
    # The fake mode is the innermost dispatch mode (it computes shapes); the counters sit above.
    calls: list[AttentionCall] = []
    flops = FlopCounterMode(display=False)
    with (
        fake_mode if fake_mode is not None else contextlib.nullcontext(),
        GpuKernelMode(calls.append, recorder.attention_core,
                      fused_rms_norm=recorder.fused_rms_norm),
        flops,
        recorder,
        torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack),
    ):
        yield flops, calls


@contextlib.contextmanager
def _reduce_hooks(modules: Sequence[nn.Module], recorder: SavedRecorder) -> Iterator[None]:
    # A row-parallel linear / vocab-parallel embedding all-reduces its output: replicated after.
    handles = [
        m.register_forward_hook(lambda _m, _i, out: recorder.clear_sharded(out)) for m in modules
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _norm_hooks(block: nn.Module, recorder: SavedRecorder) -> Iterator[None]:
    # Each norm module's call opens and closes a recorder norm scope (composite norms).
    handles = [h for m in block.modules() if is_norm(m) for h in (
        m.register_forward_pre_hook(lambda _m, args: recorder.begin_norm(args)),
        m.register_forward_hook(lambda _m, _args, _out: recorder.end_norm()))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def measure_block(
    block: nn.Module,
    call: BlockCall,
    recorder: SavedRecorder,
    reduce_modules: Sequence[nn.Module],
    fake_mode: FakeTensorMode | None,
) -> Measured:
    """Run ``block`` forward and backward on its recorded inputs under the instruments.

    Inputs other than the hidden states (rotary tables, an attention mask) are made once by the
    model and shared by every block, so they are not counted as this block's saved bytes.

    Args:
        block: the block module.
        call: its recorded call (inputs at one batch size).
        recorder: a fresh SavedRecorder (knows the parameters and the sharded ones).
        reduce_modules: row-parallel linears of the block.
        fake_mode: the FakeTensorMode the inputs were recorded in, or None (plain meta).

    Returns:
        The block's Measured.
    """
    flags = iter(call.requires_grad)

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().requires_grad_(next(flags) and t.is_floating_point())

    args, kwargs = tree_map(leaf, (call.args, call.kwargs))
    main_in = main_tensor((args, kwargs))
    shared = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    recorder.exclude([t for t in shared if t is not main_in])
    recorder.tag = "block"
    with (
        _instruments(recorder, fake_mode) as (flops, attention),
        _reduce_hooks(reduce_modules, recorder),
        _norm_hooks(block, recorder),
    ):
        out = block(*args, **kwargs)
        fwd = flops.get_total_flops()
        recorder.forward_active = False
        main_out = main_tensor(out)
        if main_out is not None and main_out.requires_grad:
            main_out.backward(torch.empty_like(main_out))
        bwd = flops.get_total_flops() - fwd
    sdpa = sum(c.fwd_flops for c in attention)
    return Measured(
        fwd_flops=fwd + sdpa,
        bwd_flops=bwd + 2 * sdpa,  # fused attention backward: 2x forward (Megatron)
        core_fwd_flops=recorder.core_fwd_flops.get("block", 0) + sdpa,
        saved=recorder.totals("block"),
        input_bytes=_nbytes(main_in),
        output_bytes=_nbytes(main_out),
        attention=tuple(attention),
        op_sac_recompute_flops=recorder.op_sac_recompute_flops.get("block", 0),
    )


class _BlockRelays:
    """Replaces each block's forward by a relay; runs each distinct block once for real."""

    def __init__(
        self, model: nn.Module, blocks: Sequence[str], signatures: dict[str, str],
        recorder: SavedRecorder,
    ):
        self.modules = dict(model.named_modules())
        self.blocks = list(blocks)
        self.signatures = signatures
        self.keys: dict[str, tuple] = {}
        self.calls: dict[tuple, BlockCall] = {}
        self.marks: dict[str, int] = {}
        self.first_in: torch.Tensor | None = None
        self.last_out: torch.Tensor | None = None
        self.flops: FlopCounterMode | None = None
        self.recorder = recorder

    def _mark(self, name: str, once: bool = False) -> None:
        if not (once and name in self.marks):
            self.marks[name] = self.flops.get_total_flops() if self.flops else 0

    def _wrap(self, fqn: str, forward: Callable) -> Callable:
        def relay(*args: Any, **kwargs: Any) -> Any:
            self._mark("first_block", once=True)
            self.recorder.tag = "blocks"
            key = (self.signatures[fqn], _signature((args, kwargs)))
            self.keys[fqn] = key
            if key not in self.calls:
                with torch.no_grad():
                    output = forward(*args, **kwargs)
                flags = [
                    t.requires_grad
                    for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor)
                ]
                detached = tree_map(
                    lambda t: t.detach() if isinstance(t, torch.Tensor) else t, (args, kwargs)
                )
                self.calls[key] = BlockCall(
                    args=detached[0], kwargs=detached[1], requires_grad=tuple(flags), output=output
                )
            main_in = main_tensor((args, kwargs))
            if self.first_in is None:
                self.first_in = main_in
            template = main_tensor(self.calls[key].output)
            relayed = _Relay.apply(main_in, template, self._on_bwd)
            out = tree_map(
                lambda t: (
                    relayed
                    if t is template
                    else (t.new_empty(t.shape) if isinstance(t, torch.Tensor) else t)
                ),
                self.calls[key].output,
            )
            self.last_out = relayed
            self._mark("last_block")
            self.recorder.tag = "head"
            return out

        return relay

    def _on_bwd(self) -> None:
        self._mark("head_bwd_end", once=True)
        self._mark("emb_bwd_start")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        for fqn in self.blocks:
            module = self.modules[fqn]
            module.forward = self._wrap(fqn, module.forward)
        try:
            yield
        finally:
            for fqn in self.blocks:
                del self.modules[fqn].forward


@contextlib.contextmanager
def _call_tracking(model: nn.Module) -> Iterator[tuple[list[str], list[str]]]:
    # Global module hooks (two handles, not two per module): first-call order and the stack of
    # running modules (a forward that raises leaves its module on top).
    names = {id(module): fqn for fqn, module in model.named_modules()}
    order: list[str] = []
    stack: list[str] = []
    seen: set[str] = set()

    def pre(module: nn.Module, _args: Any) -> None:
        fqn = names.get(id(module))
        if fqn is None:
            return
        stack.append(fqn)
        if fqn not in seen:
            seen.add(fqn)
            order.append(fqn)

    def post(module: nn.Module, _args: Any, _out: Any) -> None:
        if id(module) in names and stack:
            stack.pop()

    handles = [
        nn.modules.module.register_module_forward_pre_hook(pre),
        nn.modules.module.register_module_forward_hook(post),
    ]
    try:
        yield order, stack
    finally:
        for handle in handles:
            handle.remove()


def run_model(
    model: nn.Module,
    forward_and_loss: Callable[[], torch.Tensor],
    *,
    blocks: Sequence[str],
    signatures: dict[str, str],
    recorder: SavedRecorder,
    reduce_modules: Sequence[nn.Module],
    input_bytes: int,
    fake_mode: FakeTensorMode | None,
) -> ModelRun:
    """Run the model (blocks relayed) forward and backward; measure embedding and head.

    Args:
        model: the model (meta device, train mode).
        forward_and_loss: runs ``model`` on the batch and returns the loss.
        blocks: block FQNs (empty: the whole model is measured as one layer, "embedding").
        signatures: block FQN -> ``module_signature`` of the block.
        recorder: a fresh SavedRecorder.
        reduce_modules: the vocab-parallel embeddings (their output is all-reduced).
        input_bytes: bytes of the model's main input (token ids).
        fake_mode: a FakeTensorMode to run in, or None for plain meta tensors (faster). Fake
            tensors let models that test values skip those tests (HF: packed sequences).

    Returns:
        The ModelRun.

    Raises:
        RunFailure: the model raised; names the innermost module that was running.
    """
    relays = _BlockRelays(model, blocks, signatures, recorder)
    recorder.tag = "embedding"
    with (
        _call_tracking(model) as (order, stack),
        relays.installed(),
        _instruments(recorder, fake_mode) as (flops, _),
        _reduce_hooks(reduce_modules, recorder),
        quiet(stderr=False),  # a failure is raised as RunFailure, not logged too
    ):
        relays.flops = flops
        try:
            loss = forward_and_loss()
            fwd_total = flops.get_total_flops()
            recorder.forward_active = False
            loss.backward()
        except Exception as err:  # any failure on meta tensors: report where it happened
            raise RunFailure(stack[-1] if stack else "", err) from err
        total = flops.get_total_flops()
    if not blocks:
        whole = Measured(fwd_flops=fwd_total, bwd_flops=total - fwd_total, core_fwd_flops=0,
                         saved=recorder.totals("embedding"), input_bytes=input_bytes,
                         output_bytes=0)
        return ModelRun(embedding=whole, head=None, call_order=tuple(order))
    embedding, head = _split(relays, recorder, fwd_total, total, input_bytes)
    return ModelRun(embedding=embedding, head=head, call_order=tuple(order),
                    block_keys=relays.keys, calls=relays.calls)


def _split(
    relays: _BlockRelays, recorder: SavedRecorder, fwd_total: int, total: int, input_bytes: int
) -> tuple[Measured, Measured]:
    """Embedding and head counts from the FLOP totals marked at the first and last relay."""
    marks = relays.marks
    embedding = Measured(
        fwd_flops=marks["first_block"],
        bwd_flops=total - marks.get("emb_bwd_start", total),
        core_fwd_flops=recorder.core_fwd_flops.get("embedding", 0),
        saved=recorder.totals("embedding"),
        input_bytes=input_bytes,
        output_bytes=_nbytes(relays.first_in),
    )
    head = Measured(
        fwd_flops=fwd_total - marks["last_block"],
        bwd_flops=marks.get("head_bwd_end", total) - fwd_total,
        core_fwd_flops=recorder.core_fwd_flops.get("head", 0),
        saved=recorder.totals("head"),
        input_bytes=_nbytes(relays.last_out),
        output_bytes=0,
    )
    return embedding, head
