"""Capture the order in which a model calls its modules with torch.fx.

``torch.fx.symbolic_trace`` (with the blocks as leaves, so a 96-block model traces in
milliseconds) works on hand-written models. HF models in transformers 5 fail it; for those the
profiler takes the order its module hooks saw while running the model on meta tensors with the
blocks relayed ("modules"), a run it makes anyway. torch.export (non-strict) was the second
method until it was measured to add nothing to the hooks: its ``nn_module_stack`` is recorded at
``Module.__call__`` like a hook, so both see the same modules (the same embedding and head on 26
HF families, llama to gpt_oss and dbrx), and tracing every block cost 0.4-15 s on the meta device
for HF configs of 2-48 layers, most of their profiling time. The order tells which outside
modules form the embedding layer (called before the first block) and the head (after the last).
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

__all__ = ["CallOrder", "quiet", "trace_call_order"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CallOrder:
    """Result of the trace attempts.

    Attributes:
        method: "fx", or "" when fx failed (the profiler then takes its hooks' order).
        order: module FQNs in order of first use ("" entries never appear).
        failures: one line per failed method, e.g. "fx: ValueError: co_varnames is too small".
    """

    method: str
    order: tuple[str, ...] = ()
    failures: tuple[str, ...] = ()


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first[:200]}"


class _LeafBlockTracer(torch.fx.Tracer):
    """fx tracer that keeps the blocks as opaque calls (their insides are measured separately)."""

    def __init__(self, blocks: frozenset[nn.Module]) -> None:
        super().__init__()
        self._blocks = blocks

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return m in self._blocks or super().is_leaf_module(m, module_qualified_name)


def _add(order: list[str], fqn: str) -> None:
    if fqn and fqn not in order:
        order.append(fqn)


def _fx_order(model: nn.Module, blocks: Sequence[str]) -> tuple[str, ...]:
    modules = dict(model.named_modules())
    tracer = _LeafBlockTracer(frozenset(modules[b] for b in blocks))
    graph = tracer.trace(model)
    order: list[str] = []
    for node in graph.nodes:
        if node.op == "call_module":
            _add(order, str(node.target))
        elif node.op == "get_attr":
            _add(order, str(node.target).rpartition(".")[0])
    missing = [b for b in blocks if b not in order]
    if missing:
        raise RuntimeError(f"the traced graph never calls block {missing[0]!r} as a module")
    return tuple(order)


@contextlib.contextmanager
def quiet(stderr: bool = True) -> Iterator[None]:
    """Silence what a failing trace or meta run prints (warnings on stderr, fake tensors'
    error logs): the profiler reports the failure once, as one line."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()) if stderr else contextlib.nullcontext():
            yield
    finally:
        logging.disable(previous)


def trace_call_order(model: nn.Module, blocks: Sequence[str]) -> CallOrder:
    """Trace ``model`` with fx (the blocks as leaves) and return the module order.

    Args:
        model: the model (on the meta device).
        blocks: FQNs of its blocks (kept opaque by fx).

    Returns:
        The CallOrder; ``method`` is "" when fx failed.
    """
    try:
        return CallOrder(method="fx", order=_fx_order(model, blocks))
    except Exception as err:  # any tracer failure: the profiler's hooks give the order
        return CallOrder(method="", failures=(f"fx: {_one_line(err)}",))
