"""Tensor-parallel communication terms: the tp collectives of one layer and micro-batch.

Charged as the runtime issues them (layer_costs.py's module docstring lists them; ``collectives``
counts them, tests hold the two equal), each timed by ``comm.collective_s`` at its size.
"""

from __future__ import annotations

from autopar.config import DTYPE_BYTES, ParallelConfig
from autopar.cost_model import comm, memory
from autopar.cost_model.collectives import (
    LOSS_PARALLEL_REDUCES,
    block_tp_calls,
    grad_reductions_per_step,
    sp_norm_tensors,
)
from autopar.graph.types import LayerProfile, ModelProfile

__all__ = ["AG", "AR", "RS", "sp_gathered_inputs", "tp_collectives", "tp_modules", "tp_sharded"]

AR, AG, RS = comm.ALL_REDUCE, comm.ALL_GATHER, comm.REDUCE_SCATTER
# the fp32 [b, s] elements of the loss-parallel and width-norm all-reduces
LOSS_REDUCE_BYTES = DTYPE_BYTES["fp32"]
_NO_TP: tuple[tuple[comm.Collective, ...], ...] = ((), (), ())


def tp_sharded(layer: LayerProfile) -> bool:
    """Whether tensor parallelism splits this layer (column/row-parallel or vocab-parallel)."""
    return bool(layer.tp.colwise or layer.tp.rowwise or layer.tp.vocab_parallel)


def _tp(kind: str, size: float, calls: int, phase: str,
        counted: bool = True) -> tuple[comm.Collective, ...]:
    if calls <= 0:
        return ()
    return (comm.Collective(kind=kind, axis="tp", size_bytes=size, calls=calls,
                            per="microbatch", phase=phase, counted=counted),)


def _block_tp(layer, cfg, act_bytes: float, first_block: bool, moe_tp: str):
    forward, backward, rerun = block_tp_calls(layer, sp=cfg.sequence_parallel,
                                              first_block=first_block, moe_tp=moe_tp)
    if not (forward or backward):
        return _NO_TP

    def calls(counts, phase: str, kinds=(AR, AG, RS)) -> tuple[comm.Collective, ...]:
        return tuple(c for kind in kinds for c in _tp(kind, act_bytes, counts[kind], phase))

    base = calls(forward, "forward") + calls(backward, "backward", (AR, RS, AG))
    # Full recompute re-runs the forward's collectives but the block's last row-parallel one.
    return base, base, base + calls(rerun, "backward")


def tp_collectives(
    profile: ModelProfile, layer: LayerProfile, cfg: ParallelConfig, dtype_ratio: float,
    *, first_block: bool, loss_parallel: bool = False, moe_tp: str = "linears",
) -> tuple[tuple[comm.Collective, ...], ...]:
    """The tp collectives of one layer and micro-batch, by recompute mode (module docstring).

    Args:
        profile: the model profile (seq_len, hidden, vocab).
        layer: the layer.
        cfg: the config (tp, micro_batch, dtype, sequence_parallel).
        dtype_ratio: training-dtype bytes over profile-dtype bytes.
        first_block: whether this is the model's first block (its SP input cut).
        loss_parallel: the loss runs on the vocab-parallel logits: no logits all-gather, but
            three all-reduces of fp32 [b, s] in the forward (the logits' max, the sum of their
            exponentials and the target's logit: torch's loss_parallel and Megatron-LM's
            vocab-parallel cross entropy alike).
        moe_tp: how a MoE module talks over tp (framework_support ``moe_tp_mode``;
            ``collectives.block_tp_calls``).

    Returns:
        One tuple of Collectives per mode of ``RECOMPUTE``; empty when tp == 1.
    """
    if cfg.tp <= 1:
        return _NO_TP
    norms = _sp_norm_grads(layer, cfg)
    calls = _layer_tp_calls(profile, layer, cfg, dtype_ratio, first_block=first_block,
                            loss_parallel=loss_parallel, moe_tp=moe_tp)
    return tuple(c + norms for c in calls) if norms else calls


def _sp_norm_grads(layer: LayerProfile, cfg: ParallelConfig) -> tuple[comm.Collective, ...]:
    """All-reduces over tp of the partial gradients of sequence-parallel norm parameters
    (``collectives.sp_norm_tensors``), fp32, at each gradient reduction."""
    tensors = sp_norm_tensors(layer, cfg)
    if not tensors:
        return ()
    reductions = grad_reductions_per_step(cfg)
    return (comm.Collective(
        kind=AR, axis="tp", size_bytes=memory.GRAD_BYTES * layer.tp.sequence_param_elements
        / tensors, calls=tensors * reductions, per="step", phase="backward"),)


def _layer_tp_calls(profile: ModelProfile, layer: LayerProfile, cfg: ParallelConfig,
                    dtype_ratio: float, *, first_block: bool, loss_parallel: bool = False,
                    moe_tp: str = "linears"):
    b, w = cfg.micro_batch, DTYPE_BYTES[cfg.dtype]
    hidden_bytes = profile.seq_len * profile.hidden * b * w  # one [b, s, h] activation
    if layer.kind == "block":
        rowwise = max(1, len(layer.tp.rowwise))
        act = layer.tp.allreduce_fwd_bytes * b * dtype_ratio / rowwise or hidden_bytes
        calls = _block_tp(layer, cfg, act, first_block, moe_tp)
        if calls is _NO_TP:
            return calls
        more = _width_norms_tp(len(layer.tp.width_norms), profile.seq_len * b)
        if moe_tp == "rows" and layer.moe is not None:
            rows = _routed_rows_tp(profile.seq_len * b * layer.moe.routed_rows_per_token()
                                   * layer.moe.hidden * w)
            more = (more[0] + rows[0], more[1] + rows[1])
        none, selective, full = calls
        return none + more[0], selective + more[0], full + more[1]
    if not layer.tp.vocab_parallel:
        return _NO_TP
    if layer.kind == "embedding":  # vocab-parallel lookup: all-reduce of its output
        calls = _tp(AR, layer.tp.allreduce_fwd_bytes * b * dtype_ratio or hidden_bytes, 1,
                    "forward")
    elif layer.kind == "head":  # logits all-gathered over the vocabulary
        # The loss's all-reduces run inside DTensor's op dispatch, which the runtime's
        # collective counter does not see (collectives.py): timed, not counted.
        logits = (_tp(AR, profile.seq_len * b * LOSS_REDUCE_BYTES, LOSS_PARALLEL_REDUCES,
                      "forward", counted=False) if loss_parallel
                  else _tp(AG, profile.seq_len * profile.vocab * b * w, 1, "forward"))
        if cfg.sequence_parallel:
            calls = (_tp(AG, hidden_bytes, 1, "forward") + logits
                     + _tp(RS, hidden_bytes, 1, "backward"))
        else:
            calls = logits + _tp(AR, hidden_bytes, 1, "backward")
    else:
        return _NO_TP
    return calls, calls, calls  # the runtime recomputes blocks only


def _width_norms_tp(norms: int, tokens: float) -> tuple[tuple[comm.Collective, ...], ...]:
    """The all-reduces of norms over a split linear's whole output (``TPStructure.width_norms``:
    OLMo 2's q_norm and k_norm): each norm's fp32 mean of squares ([b, s]) summed over tp
    forward, its gradient backward; (without, with a full recompute's re-run of the forward's).
    They run inside DTensor's op dispatch, which the runtime's counter does not see: timed, not
    counted (as the loss-parallel all-reduces)."""
    if norms <= 0:
        return (), ()

    def reduce(phase: str) -> tuple[comm.Collective, ...]:
        return _tp(AR, tokens * LOSS_REDUCE_BYTES, norms, phase, counted=False)

    base = reduce("forward") + reduce("backward")
    return base, base + reduce("backward")


def _routed_rows_tp(rows_bytes: float) -> tuple[tuple[comm.Collective, ...], ...]:
    """The routed rows' tp collectives of a framework whose token dispatcher gathers them
    (``Framework.moe_tp`` "rows": Megatron-Core's alltoall dispatcher): an all-gather of the
    ``rows_bytes`` dispatched rows before the experts and a reduce-scatter after them, their
    mirror in the backward; (without, with a full recompute's re-run of the forward's)."""
    base = (_tp(AG, rows_bytes, 1, "forward") + _tp(RS, rows_bytes, 1, "forward")
            + _tp(RS, rows_bytes, 1, "backward") + _tp(AG, rows_bytes, 1, "backward"))
    return base, base + _tp(AG, rows_bytes, 1, "backward") + _tp(RS, rows_bytes, 1, "backward")


def tp_modules(layer: LayerProfile, cfg: ParallelConfig) -> int:
    """Tensor-parallel modules of a layer when tp > 1 (linears, vocab-parallel, SP norms)."""
    if cfg.tp <= 1 or not tp_sharded(layer):
        return 0
    t = layer.tp
    sp = len(t.sequence) if cfg.sequence_parallel else 0
    return len(t.colwise) + len(t.rowwise) + len(t.vocab_parallel) + sp


def sp_gathered_inputs(layer: LayerProfile, moe_tp: str = "linears") -> int:
    """[s, h] inputs that sequence parallelism all-gathers in one layer's forward and that the
    linears keep whole: one per column-parallel parent module of a block (q/k/v share one,
    the MLP's input projections another), one for the vocab-parallel head. A MoE module that
    gathers its input at its boundary (``moe_tp`` "gather" or "boundary": framework_support
    ``moe_tp_mode``) keeps one for itself and its shared experts; "rows" gathers the routed
    rows inside it instead (layer_terms.py)."""
    if layer.kind == "block":
        if not layer.tp.rowwise:
            return 0
        parents = {fqn.rsplit(".", 1)[0] for fqn in layer.tp.colwise}
        moe = layer.moe
        if moe_tp in ("gather", "boundary") and moe is not None and parents:
            return sum(1 for p in parents if not moe.holds(p)) + 1
        return len(parents)
    return 1 if layer.kind == "head" and layer.tp.vocab_parallel else 0
