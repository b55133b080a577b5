"""Capture the order in which a model calls its modules: torch.fx first, torch.export second.

``torch.fx.symbolic_trace`` (with the blocks as leaves, so a 96-block model traces in
milliseconds) works on hand-written models; HF models in transformers 5 fail it and go to
``torch.export.export(strict=False)``. When both fail, the profiler falls back to the order seen by
module hooks while running the model on meta tensors ("modules"). The order tells which outside
modules form the embedding layer (called before the first block) and the head (after the last).
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["CallOrder", "quiet", "trace_call_order"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CallOrder:
    """Result of the trace attempts.

    Attributes:
        method: "fx", "export", or "" when both failed.
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
    """Silence what a failing trace or meta run prints (torch.export's partial graph on stderr,
    fake tensors' error logs): the profiler reports the failure once, as one line."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()) if stderr else contextlib.nullcontext():
            yield
    finally:
        logging.disable(previous)


def _export_order(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[str, ...]:
    with quiet():
        program = torch.export.export(model, args, kwargs=kwargs, strict=False)
    order: list[str] = []
    for node in program.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            _add(order, str(path))
    return tuple(order)


def trace_call_order(
    model: nn.Module, blocks: Sequence[str], args: tuple, kwargs: dict[str, Any]
) -> CallOrder:
    """Trace ``model`` with fx, then with torch.export (non-strict), and return the module order.

    Args:
        model: the model (on the meta device).
        blocks: FQNs of its blocks (kept opaque by fx).
        args: positional example inputs (meta tensors).
        kwargs: keyword example inputs (e.g. ``use_cache=False`` for HF models).

    Returns:
        The CallOrder; ``method`` is "" when neither tracer worked.
    """
    failures: list[str] = []
    try:
        return CallOrder(method="fx", order=_fx_order(model, blocks))
    except Exception as err:  # any tracer failure means: try the next method
        failures.append(f"fx: {_one_line(err)}")
    try:
        return CallOrder(
            method="export", order=_export_order(model, args, kwargs), failures=tuple(failures)
        )
    except Exception as err:  # any export failure means: fall back to module hooks
        failures.append(f"export: {_one_line(err)}")
    return CallOrder(method="", failures=tuple(failures))
