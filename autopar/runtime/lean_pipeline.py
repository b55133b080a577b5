"""Pipeline stages and schedules that hold stage-boundary tensors only for micro-batches in flight.

torch's ``PipelineStage`` allocates, when it is first set up, one receive buffer per micro-batch
for the stage input (``args_recv_info``) and one for the output gradient (``grad_recv_info``), and
keeps all of them for as long as the stage lives; with the backward split into input and weight
passes each input buffer also keeps its micro-batch's input gradient on ``.grad``. Megatron-LM
instead receives into a fresh tensor per transfer and lets it go with the micro-batch.
``LeanPipelineStage`` does the same with the smallest override of torch's class:

- set-up: the per-micro-batch buffers torch just made are dropped (``None``; their metadata stays);
- ``get_fwd_recv_ops`` / ``get_bwd_recv_ops``: the micro-batch's buffer is allocated from that
  metadata right before its receive is posted;
- ``forward_one_chunk``: the stage no longer refers to the input buffer afterwards (it lives on
  as the micro-batch's autograd leaf until its backward, as any stage input must);
- ``backward_one_chunk``: the output-gradient buffer is dropped; the last stage detaches the
  micro-batch's loss (the schedule keeps the losses to the end of the step, and a loss's graph
  would keep the stage input alive through its AccumulateGrad node); after a backward-input pass
  the input gradient is taken off the leaf's ``.grad`` (it is sent, not accumulated) and the
  output gradient is dropped from the state kept for the weight pass, which needs it only on
  stage 0.

Every schedule reaches the buffers through these methods (GPipe and 1F1B directly, the
interleaved, zero-bubble, ZBV and DualPipeV runtime through its RECV_F / RECV_B actions).

The sending side needs one more change for the action-list runtime (``_PipelineScheduleRuntime``:
interleaved 1F1B, interleaved zero bubble, ZBV, DualPipeV): it keeps every send's ``Work`` until
the step ends, and a gloo or NCCL send ``Work`` holds its tensor, so every micro-batch's stage
output and input gradient would stay allocated for the whole step. ``lean_schedule_class`` gives
such a schedule SEND_F / SEND_B handlers that post the same sends and wait (then drop) each one
as soon as its completion is certain from the schedule itself: once the peer's next send back to
this rank, issued after the peer consumed ours, has been received (``send_release_positions``).
A wait at that point never blocks on a peer, so no ordering changes and no deadlock is possible.
Sends with no such later message (the cool-down's last few) are waited at the step's end, as
torch does. GPipe and 1F1B wait their sends themselves and are used unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    FORWARD,
    FULL_BACKWARD,
    SEND_B,
    SEND_F,
    _batch_p2p,
    _wait_batch_p2p,
)

__all__ = ["LeanPipelineStage", "lean_schedule_class", "send_release_positions"]


class LeanPipelineStage(PipelineStage):
    """A ``PipelineStage`` whose receive buffers live only while their micro-batch needs them.

    Same constructor and behaviour as ``torch.distributed.pipelining.PipelineStage``; gradients
    are bit-identical (the same tensors are received and the same autograd calls run).
    """

    def _allocate(self, recv_infos: Iterable[Any]) -> None:
        # A fresh buffer per transfer, from the metadata torch recorded at set-up.
        for info in recv_infos:
            if not info.is_root_arg and info.tensor_meta is not None and info.buffer is None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

    @staticmethod
    def _release(recv_infos: Iterable[Any]) -> None:
        # None marks "not allocated"; torch's own use of a missing buffer raises loudly.
        for info in recv_infos:
            if not info.is_root_arg and info.tensor_meta is not None:
                info.buffer = None

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        """torch's set-up, then drop the per-micro-batch input buffers it allocated."""
        out = super()._prepare_forward_infra(*args, **kwargs)
        for recv_infos in self.args_recv_info.values():
            self._release(recv_infos)
        return out

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        """torch's set-up, then drop the per-micro-batch output-gradient buffers it allocated."""
        out = super()._prepare_backward_infra(*args, **kwargs)
        for recv_infos in self.grad_recv_info.values():
            self._release(recv_infos)
        return out

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        """Allocate this micro-batch's input buffer, then torch's receive ops into it."""
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        """Allocate this micro-batch's output-gradient buffer, then torch's receive ops."""
        if self.has_backward and not self.is_last:
            self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        """V schedules: torch zeroes the buffer for a None gradient, so one must exist."""
        if any(grad is None for grad in next_stage_bwd_outputs):
            self._allocate(self.grad_recv_info[mb_index])
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """torch's forward; the input buffer is then referenced only by the autograd graph."""
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not self.is_first:
            self._release(self.args_recv_info[fwd_chunk_id])
        return output

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        """torch's backward, then let go of what this micro-batch received."""
        super().backward_one_chunk(
            bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
        )
        if not self.has_backward:
            return
        if not self.is_last:
            self._release(self.grad_recv_info[bwd_chunk_id])
        elif isinstance(loss, torch.Tensor) and not loss._is_view():
            # The schedule keeps every micro-batch's loss until the step ends; its autograd
            # graph (freed of saved tensors, but not of the leaf its AccumulateGrad node
            # holds) would keep the stage input alive with it.
            loss.detach_()
        state = self.backward_state.get(bwd_chunk_id)
        if full_backward or state is None:
            return
        input_values, param_groups, stage_output, _output_grads = state
        # stage_backward_input left the input gradient on the leaf's .grad; bwd_cache holds it
        # for the send, so the leaf (kept for the weight pass) need not.
        for value in input_values:
            if isinstance(value, torch.Tensor) and value.grad is not None:
                value.grad = None
        # The weight pass reads the output gradient only on stage 0 (torch's
        # backward_weight_one_chunk re-runs a full backward there).
        if self.stage_index != 0:
            self.backward_state[bwd_chunk_id] = (input_values, param_groups, stage_output, None)


# Action key: (stage index, "F" or "B", micro-batch). "B" is the backward that consumes a
# received output gradient (full backward or backward-input).
_Key = tuple[int, str, int]


def _compute_actions(actions: list[Any]) -> Iterator[tuple[int, Any]]:
    # (position, action) with OVERLAP_F_B expanded into its sub-actions at the parent's position.
    for pos, action in enumerate(actions):
        if action is not None:
            yield from ((pos, sub) for sub in (action.sub_actions or (action,)))


def _consumer_positions(actions: list[Any]) -> dict[_Key, int]:
    # Where a rank waits for a received tensor: its forward (input) or backward (output grad).
    positions: dict[_Key, int] = {}
    for pos, a in _compute_actions(actions):
        if a.computation_type == FORWARD:
            positions[(a.stage_index, "F", a.microbatch_index)] = pos
        elif a.computation_type in (FULL_BACKWARD, BACKWARD_INPUT):
            positions[(a.stage_index, "B", a.microbatch_index)] = pos
    return positions


def _destination(action: Any) -> _Key:
    # The compute that consumes what a SEND_F / SEND_B action sends.
    if action.computation_type == SEND_F:
        return (action.stage_index + 1, "F", action.microbatch_index)
    return (action.stage_index - 1, "B", action.microbatch_index)


def send_release_positions(
    order: dict[int, list[Any]], rank: int, stage_to_rank: Callable[[int], int]
) -> dict[Any, int | None]:
    """When each of ``rank``'s sends has certainly completed, from the schedule alone.

    A send X to rank q is consumed on q by the compute that waits for it (forward of the next
    stage, or backward of the previous one). The first send Y that q posts to ``rank`` after that
    compute was issued after q had received all of X; so once ``rank`` has waited for Y (at the
    compute consuming Y, position P), X's ``Work`` is complete and waiting on it cannot block.

    Args:
        order: the schedule's ``pipeline_order_with_comms`` (pp rank -> actions).
        rank: this pp rank.
        stage_to_rank: stage index -> pp rank.

    Returns:
        For each SEND_F / SEND_B action of ``rank``: P (release the send at any later action),
        or None when no later message proves it (wait at the step's end).
    """
    consumers = {q: _consumer_positions(actions) for q, actions in order.items()}
    sends_to: dict[int, list[tuple[int, _Key]]] = {q: [] for q in order}
    for q, actions in order.items():
        for pos, a in enumerate(actions):
            if a is not None and a.computation_type in (SEND_F, SEND_B):
                dest = _destination(a)
                sends_to[q].append((pos, dest))
    release: dict[Any, int | None] = {}
    for action in order[rank]:
        if action is None or action.computation_type not in (SEND_F, SEND_B):
            continue
        dest = _destination(action)
        peer = stage_to_rank(dest[0])
        consumed_at = consumers[peer][dest]
        reply = next(
            (d for pos, d in sends_to[peer] if pos > consumed_at and stage_to_rank(d[0]) == rank),
            None,
        )
        release[action] = None if reply is None else consumers[rank][reply]
    return release


def _lean_send(action: Any, ctx: Any) -> None:
    # SEND_F / SEND_B handler: torch's send, then wait and drop the sends proven complete.
    schedule = ctx.schedule_ref
    stage = next(s for s in schedule._stages if s.stage_index == action.stage_index)
    mb = action.microbatch_index
    ops = stage.get_fwd_send_ops(mb) if action.computation_type == SEND_F else (
        stage.get_bwd_send_ops(mb)
    )
    release, positions = schedule._lean_release, schedule._lean_positions
    position = positions[action]
    pending = [(p, works) for p, works in schedule._lean_pending if p is None or p >= position]
    for p, works in schedule._lean_pending:
        if p is not None and p < position:
            _wait_batch_p2p(works)
    pending.append((release[action], _batch_p2p(ops, desc="lean_send")))
    schedule._lean_pending = pending


class _LeanSends:
    """Mixin for a ``_PipelineScheduleRuntime`` class: sends released when proven complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lean_pending: list[tuple[int | None, list[Any]]] = []
        self._lean_release: dict[Any, int | None] = {}
        self._lean_positions: dict[Any, int] = {}
        self._lean_order: Any = None
        # NOTE: register_custom_function admits compute actions only, but the runtime looks every
        # action up in this map first; SEND_F / SEND_B handlers replace its own deferred sends.
        self._comp_type_to_function_map[SEND_F] = _lean_send
        self._comp_type_to_function_map[SEND_B] = _lean_send

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> Any:
        """torch's step, then wait for the sends not yet proven complete (as torch does)."""
        order = self.pipeline_order_with_comms
        if getattr(self, "_lean_order", None) is not order:  # once per action list, not per step
            self._lean_order = order
            self._lean_positions = {
                a: pos for pos, a in enumerate(order[self.rank]) if a is not None}
            self._lean_release = send_release_positions(
                order, self.rank, lambda s: self.stage_index_to_group_rank[s]
            )
        self._lean_pending = []
        try:
            result = super()._step_microbatches(*args, **kwargs)
            for _, works in self._lean_pending:
                _wait_batch_p2p(works)
        finally:
            self._lean_pending = []
        return result


def lean_schedule_class(cls: type) -> type:
    """``cls`` itself, or for a ``_PipelineScheduleRuntime`` subclass one with lean sends."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    if not issubclass(cls, _PipelineScheduleRuntime):
        return cls
    return type(f"Lean{cls.__name__}", (_LeanSends, cls), {"__module__": __name__})
