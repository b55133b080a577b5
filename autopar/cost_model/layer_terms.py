"""A layer's memory terms for the cost table: saved activations and transient working set,
of the layer as the framework runs it (``framework_layer``: its fused kernels and policies).

Bytes of one micro-batch on one rank, by recompute mode (none, selective, full), from the
profile's per-sample counts (``memory.activation_bytes``, ``memory.transient_bytes``) and what the
framework keeps (``Framework``: vocab-parallel loss, SP re-gathers, ZeRO-3 gather buckets).
"""

from __future__ import annotations

import dataclasses

from autopar.config import DTYPE_BYTES, ParallelConfig, dp_mechanism
from autopar.cost_model import memory
from autopar.cost_model.dp_comm import RootShare
from autopar.cost_model.framework_support import moe_tp_mode
from autopar.cost_model.frameworks import GATHER_BUCKET, Framework
from autopar.cost_model.precision import fp8_linears
from autopar.cost_model.tp_comm import sp_gathered_inputs
from autopar.graph.types import LayerProfile, ModelProfile

__all__ = ["activation_bytes_of", "framework_layer", "grad_bytes_of", "kept_less_of",
           "net_of_backward_state", "static_grad_element_bytes", "transient_bytes_of",
           "weight_pass_bytes_of"]


def activation_bytes_of(profile: ModelProfile, layer, cfg: ParallelConfig, ratio: float,
                      shard: int, fw: Framework, head_elems: float) -> tuple[float, float, float]:
    """Saved activation bytes of one micro-batch by recompute mode (``memory.activation_bytes``).

    autopar's runtime all-gathers the vocab-parallel head's logits before an ordinary loss
    (runtime/tensor_parallel.py): every tp rank holds the whole [b, s, V] logits and
    log-softmax. A framework with a vocab-parallel loss keeps them sharded. A framework whose
    dispatcher gathers the routed rows over tp (``Framework.moe_tp`` "rows") keeps them whole
    for the experts' backward (k [h] rows a token), whether or not it re-gathers the linears'
    inputs.
    """
    gathered_logits = layer.kind == "head" and bool(layer.tp.vocab_parallel) and (
        not fw.loss_parallel)
    mode = moe_tp_mode(fw, cfg)
    gathered = 0.0 if fw.sp_regathers_inputs else sp_gathered_inputs(layer, mode) * profile.hidden
    if mode == "rows" and layer.moe is not None:  # the dispatched rows the experts keep whole
        gathered += layer.moe.routed_rows_per_token() * layer.moe.hidden
    return memory.activation_bytes(
        layer, cfg, dtype_ratio=ratio, tp_sharded=shard > 1, logprob_elements=head_elems,
        gathered_logits=gathered_logits,
        sp_gathered_bytes=gathered * profile.seq_len * DTYPE_BYTES[profile.dtype],
        selective_keeps_gathered=fw.selective_policy != "op",
        fp32_logprobs=profile.loss != "fused",
    )


def weight_pass_bytes_of(layer: LayerProfile, cfg: ParallelConfig, ratio: float, shard: int
                         ) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Under a split backward, by recompute mode: what one micro-batch of ``layer`` holds
    beyond its activations from its input pass to its weight pass, and what that input pass
    frees of them (torch's ``stage_backward_input`` keeps the output gradients of the weight
    ops for ``stage_backward_weight`` and frees the saved tensors after the stage's last weight
    op: ``LayerProfile.weight_pass_grad_bytes``, ``input_pass_freed_bytes``;
    tests/unit/test_graph_weight_pass.py measures both on CPU).

    Args:
        layer: the profile layer.
        cfg: the config (micro_batch, tp, sequence_parallel).
        ratio: training-dtype bytes over profile-dtype bytes.
        shard: tp when tensor parallelism splits this layer's activations, else 1.

    Returns:
        (kept, freed), each by recompute mode (none, selective, full). Under tensor
        parallelism the sharded part divides by tp; under sequence parallelism the replicated
        part too, except the gradients of reduced outputs (a row-parallel linear's partial
        sums: whole on every rank). Full recompute frees nothing at the input pass (the
        layer's recomputed tensors go, the checkpoint's input stays). Freed bytes are the
        head's only (``LayerCost.input_pass_freed_bytes``).
    """
    (all_g, rep, reduced), (all_f, freed_rep) = (layer.weight_pass_grad_bytes,
                                                 layer.input_pass_freed_bytes)
    grads, freed = float(all_g), float(all_f)
    if shard > 1 and cfg.tp > 1:
        sp = cfg.tp if cfg.sequence_parallel else 1
        grads = (all_g - rep) / cfg.tp + (rep - reduced) / sp + reduced
        freed = (all_f - freed_rep) / cfg.tp + freed_rep / sp
    if layer.kind != "head":
        freed = 0.0
    scale = cfg.micro_batch * ratio
    return (grads * scale,) * 3, (freed * scale, freed * scale, 0.0)


def transient_bytes_of(layer, cfg: ParallelConfig, act, held: float, shard: int, ratio: float,
                     fw: Framework, head_elems: float, loss: str = "eager",
                     root: RootShare | None = None) -> tuple[float, float, float]:
    """The layer's working set beyond its saved activations, by recompute mode (``held``:
    the parameters the rank holds after tp and ep sharding; ``loss``: the profile's loss
    kernel, ``ModelProfile.loss``; ``root``: ``dp_comm.root_share`` for a layer of the held
    root unit, whose own gathered parameters (and gradient, but the first's) the root's
    buffers hold, not its working set)."""
    w, b = DTYPE_BYTES[cfg.dtype], cfg.micro_batch
    fsdp = dp_mechanism(cfg) == "fsdp"
    gathered = fsdp and cfg.zero == 3 and not memory.fsdp_keeps_params_unsharded(cfg)
    # The backward's fresh gradient (training dtype), plus its fp32 copy unless it accumulates
    # into the (static) fp32 accumulator.
    # (fp32 training: the fresh gradient is already the fp32 one, no copy.)
    fresh_grad = w if memory.fsdp_accumulates_grads(cfg) or cfg.dtype == "fp32" else (
        w + memory.GRAD_BYTES)
    sp_div = cfg.tp if (cfg.sequence_parallel and shard > 1) else 1
    gathered_bytes = 2 * w * held if gathered else 0.0
    # a static gradient buffer takes the weight gradients as the GEMMs make them
    unsharded_grad_bytes = fresh_grad * held if fsdp and not fw.static_grad_buffer else 0.0
    if root is not None:  # the root's own gather is held all step: the next unit's beside it
        gathered_bytes = w * root.prefetch_params if gathered else 0.0
        # the root holds its gradient; the first layer's backward ends with the root's reduce,
        # which casts every root gradient to the reduce dtype
        unsharded_grad_bytes = 0.0 if root.holds_grad else (
            fresh_grad * held + (fresh_grad - w) * root.other_params)
    if fw.zero3_gather == GATHER_BUCKET:  # bounded buckets instead of whole blocks
        gathered_bytes = min(gathered_bytes, w * fw.zero3_live_params)
        unsharded_grad_bytes = min(unsharded_grad_bytes, fresh_grad * fw.reduce_bucket_params)
    return memory.transient_bytes(
        act,
        output_bytes=layer.output_bytes * b * ratio / sp_div,
        gathered_param_bytes=gathered_bytes,
        unsharded_grad_bytes=unsharded_grad_bytes,
        # The loss's backward: the logits (w) beside two fp32 [b, s, V] gradients, of the
        # log-probabilities (nll_loss_backward) and of the logits (log_softmax_backward); a
        # fused loss keeps its logits saved and allocates one gradient at their dtype, and so
        # does a loss whose backward works in place on its saved softmax.
        logits_bytes=(w if loss == "fused" or fw.loss_grad_in_place
                      else w + 2 * memory.FP32_LOGPROB_BYTES)
        * head_elems * b / (shard if fw.loss_parallel else 1),
    )


def framework_layer(layer: LayerProfile, fw: Framework) -> LayerProfile:
    """``layer`` as ``fw`` runs it: a fused SwiGLU kernel (``fused_swiglu``) does not keep the
    activated gate (``LayerProfile.swiglu_saved_bytes``, sharded like the rest of the MLP), nor
    an attention kernel that reads grouped-query attention's kv heads in place (``native_gqa``)
    their repeated copies (``LayerProfile.kv_repeat_saved_bytes``, sharded like K and V);
    under per-op selective checkpointing (``selective_policy`` "op") a measured block's
    ``selective`` entries are its ``LayerProfile.op_sac`` counts."""
    dropped = (layer.swiglu_saved_bytes if fw.fused_swiglu else 0) + (
        layer.kv_repeat_saved_bytes if fw.native_gqa else 0)
    if dropped:
        layer = _less_saved(layer, dropped, 0)
    op = layer.op_sac
    if fw.selective_policy != "op" or op is None:
        return layer
    return dataclasses.replace(
        layer,
        saved_bytes={**layer.saved_bytes, "selective": op.saved_bytes},
        saved_bytes_replicated={**layer.saved_bytes_replicated,
                                "selective": op.saved_bytes_replicated},
        recompute_flops={**layer.recompute_flops, "selective": op.recompute_flops})


def _less_saved(layer: LayerProfile, dropped: int, dropped_replicated: int) -> LayerProfile:
    """``layer`` keeping ``dropped`` bytes less (``dropped_replicated`` of them replicated) per
    sample without recompute and under selective recompute (full keeps the input only)."""
    def less(values: dict[str, int], by: int) -> dict[str, int]:
        return {mode: value - by if mode != "full" else value for mode, value in values.items()}

    return dataclasses.replace(
        layer, saved_bytes=less(layer.saved_bytes, dropped),
        saved_bytes_replicated=less(layer.saved_bytes_replicated, dropped_replicated))


def _fp8_dropped(layer, cfg: ParallelConfig, fw: Framework) -> tuple[int, int]:
    """(bytes, replicated part) per sample that fp8 linears keeping their fp8 input
    (``Framework.fp8_saves_inputs``) hold less than the 16-bit count: what only linears save at
    half its bytes, plus an fp8 copy of what they share with another op
    (``LayerProfile.linear_saved_bytes``, ``linear_shared_bytes``; graph/recorder.py). Memory
    only: the casts and elementwise passes still read and write the 16-bit tensors."""
    if not (fw.fp8_saves_inputs and fp8_linears(cfg.dtype, layer.kind)):
        return (0, 0)
    (only, only_rep), (shared, shared_rep) = layer.linear_saved_bytes, layer.linear_shared_bytes
    return ((only - shared) // 2, (only_rep - shared_rep) // 2)


def _kernels_dropped(layer, fw: Framework) -> tuple[int, int]:
    """(bytes, replicated part) per sample that ``fw``'s own kernels hold less than the traced
    module: fused norms (``Framework.fused_norms``) keep no composite norm's fp32 copies
    (``LayerProfile.norm_saved_bytes``), a scatter combine (``Framework.scatter_combine``) no
    index_add copy of the expert outputs (``LayerProfile.combine_saved_bytes``;
    graph/recorder.py). Memory only: keeping index_add's source moves no bytes, and the
    elementwise traffic term stays the one fitted on the traced counts."""
    norm = layer.norm_saved_bytes if fw.fused_norms else (0, 0)
    combine = layer.combine_saved_bytes if fw.scatter_combine else (0, 0)
    return (norm[0] + combine[0], norm[1] + combine[1])


def kept_less_of(profile: ModelProfile, layer, cfg: ParallelConfig, ratio: float, shard: int,
                 fw: Framework, head_elems: float,
                 full: tuple[float, float, float]) -> tuple[float, float, float]:
    """Activation bytes (none, selective, full) the framework keeps less than ``full``
    (``activation_bytes_of`` the traced layer): its fp8 linears' inputs and its own kernels
    (``_fp8_dropped``, ``_kernels_dropped``); memory only."""
    fp8, own = _fp8_dropped(layer, cfg, fw), _kernels_dropped(layer, fw)
    dropped, dropped_rep = fp8[0] + own[0], fp8[1] + own[1]
    if not dropped:
        return (0.0, 0.0, 0.0)
    kept = _less_saved(layer, dropped, dropped_rep)
    less = activation_bytes_of(profile, kept, cfg, ratio, shard, fw, head_elems)
    return (full[0] - less[0], full[1] - less[1], full[2] - less[2])


def net_of_backward_state(act: tuple[float, float, float], cfg: ParallelConfig,
                           local_params: float, params_tp: float,
                           fw: Framework) -> tuple[float, float, float]:
    """Saved activations net of the model state that the backward creates in their place.

    When every forward of the step runs before any backward (one micro-batch, or a GPipe
    pipeline), the state born in the backward never peaks together with all the activations:
    the gradients (freed at every step's end, ``zero_grad(set_to_none=True)``; 4 bytes per
    local parameter) or FSDP2's unsharded fp32 gradient accumulators (4 bytes per parameter).
    A layer's share x appears in the first backward as that micro-batch's activations a of
    the layer are released, so the layer peaks at (m - 1) a + max(a, x). The table's memory
    adds x (static) to m a (assemble.py), so a is charged as a - min(a, x) / m (with one
    micro-batch: max(0, a - x)). With other schedules (and with gradient accumulation at
    pp == 1) the state exists from the first backward on while later forwards still save
    activations: both are charged in full; and so with a static gradient buffer
    (``fw.static_grad_buffer``), which exists before the first forward.
    """
    m = cfg.num_microbatches
    if fw.static_grad_buffer or (m > 1 and not (cfg.pp > 1 and cfg.schedule == "gpipe")):
        return act
    # The fp32 gradient: the local one, or FSDP2's unsharded accumulator (which the sharded one
    # replaces at its reduce-scatter: memory.layer_state charges the larger of the two).
    born = memory.GRAD_BYTES * local_params
    if memory.fsdp_accumulates_grads(cfg):
        born = memory.GRAD_BYTES * params_tp
    # Zero 3's unsharded parameters under a pipeline are not born in the backward: measured
    # (gpt dp2 pp2 gpipe zero 3 of benchmarks/accuracy.py) they are live before the step's first
    # forward (the stage root is never resharded, the blocks' all-gathers persist), so they
    # peak with all the activations and are not netted.
    return (act[0] - min(act[0], born) / m, act[1] - min(act[1], born) / m,
            act[2] - min(act[2], born) / m)


def static_grad_element_bytes(fw: Framework, dtype: str) -> int:
    """Bytes an element of a static gradient buffer takes: the reduce dtype's, and fp32's when
    the parameters are fp32 (Megatron-LM's main_grad is never narrower than them)."""
    return memory.GRAD_BYTES if dtype == "fp32" else fw.grad_reduce_bytes


def grad_bytes_of(state: memory.LayerState, params_tp: float, fw: Framework,
                  dtype: str) -> float:
    """The gradient bytes a rank holds for a layer of ``params_tp`` parameters (after tp and
    ep) whose state without them is ``state`` (``memory.layer_state``, offload applied):
    ``fw``'s static buffer (``static_grad_element_bytes`` a parameter), else memory.py's
    gradients in ``fw``'s reduce dtype."""
    if fw.static_grad_buffer:
        return static_grad_element_bytes(fw, dtype) * params_tp
    return state.grad_bytes * fw.grad_reduce_bytes / memory.GRAD_BYTES
