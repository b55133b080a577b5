"""Bytes saved for backward, by storage, with what tensor parallelism shards and the attention core.

``SavedRecorder`` is installed as the pack hook of ``torch.autograd.graph.saved_tensors_hooks`` and,
as a ``TorchDispatchMode``, follows two properties of every tensor through the ops:

- *sharded*: computed from a parameter that tensor parallelism shards (a column-parallel weight,
  the vocabulary-parallel embedding / lm head), and not yet reduced (a row-parallel linear or a
  vocab-parallel embedding clears it on its output, where the all-reduce happens). Saved tensors
  with it shrink by ``tp``; the others (norm inputs, the residual stream, the inputs of the
  column-parallel linears, dropout masks on the residual) are Korthikanti's replicated part.
- *core*: computed by the attention core, i.e. from an activation x activation matmul (q k^T) up to
  the next one (attention-over-V), which ends it. Tensors saved only by the core (scores, softmax,
  dropout mask on the scores) are what selective recomputation drops; the core's inputs q, k, v
  are kept. The fused SDPA stand-in marks what its kernel saves (output, log-sum-exp) the same way.

Per-op selective checkpointing (torchtitan's ``selective_ac_option = "op"``) keeps, of a
checkpointed block, its input and the outputs of the ops in its save list: the fused attention
kernel's and every odd-numbered ``aten.mm`` (torchtitan's policy recomputes every second one);
everything else runs again in the backward. The recorder sums those outputs (``op_sac``) and the
FLOPs the policy re-runs (the even-numbered matmuls and any activation x activation matmul).

*SwiGLU's activated gate*: the outputs of ``aten.silu`` that are saved (by the gate x up product).
A fused SwiGLU kernel (Megatron-LM's ``bias_swiglu_fusion``) saves its input and recomputes
them in the backward; ``swiglu_bytes`` is what it does not keep.

*Repeated K/V of grouped-query attention*: a model that repeats its kv heads up to the query
heads before the attention kernel (the zoo's ``repeat_interleave``, Hugging Face's
``repeat_kv``: an ``expand`` made contiguous by ``aten.clone``) saves the repeated copies for the
kernel's backward. The recorder notes every clone of a tensor with a broadcast (stride-0)
dimension and the factor it repeats by; ``kv_repeat_bytes`` is the saved part beyond one copy,
what a kernel that reads the kv heads in place (FlashAttention's, cuDNN's) does not keep.

*Inputs of the weight matmuls*: a tensor saved by a matmul whose other operand is a parameter
(a linear's input, kept for its weight gradient) is noted as a linear's; ``linear_bytes`` is
what only linears keep, ``linear_shared_bytes`` what a linear and another op both keep (the
attention output, kept by the attention's backward too). A framework whose fp8 linears keep
their fp8 input instead (Transformer Engine) keeps the first at half and adds half of the
second (cost_model/layer_terms.py). Autograd packs an op's inputs just before the op reaches
the dispatch modes (and its outputs just after), so the packs since the last dispatched op are
attributed when the next op arrives: to it if it is a weight matmul taking them, else to others.

*Composite norms*: a norm written as elementwise ops (Hugging Face's ``*RMSNorm``: an fp32 copy
of its input, ``rsqrt``, the normalised 16-bit product) keeps more than a fused norm kernel,
which keeps its input and at most two fp32 statistics a row (mean, ``1/rms``). While a norm
module runs (``begin_norm`` to ``end_norm``, called by graph/measure.py), the storages first
saved inside it are noted; ``norm_bytes`` is what they hold beyond the fused kernel's input and
statistics (0 for a norm that already runs as one kernel: ``F.rms_norm`` as ``GpuKernelMode``
stands it in, ``F.layer_norm``).

*Combine copies*: ``index_add`` (Hugging Face's experts, graph/moe.py's stand-in) keeps its
source for the backward, where only its shape is used; ``combine_bytes`` is what it keeps, a
copy a combine that scatters (``scatter_add``, keeping the indices only) does not.

*A split backward's bytes* (torch's ``stage_backward_input`` then ``stage_backward_weight``):
the input pass keeps, for the weight pass, the gradient of every op that takes a parameter
and an activation (a weight op: the linears' matmuls, the norms' weight products, an
embedding), and frees the saved tensors of the ops after the layer's last weight op (the
loss), whose autograd nodes no weight op reaches. ``weight_grad_bytes`` is the first output of
every weight op (its gradient's size), with the part tensor parallelism does not shard and the
part that sequence parallelism does not shard either (an output made sharded and reduced over
tp afterwards: a row-parallel linear's partial sums, whose gradient is whole on every rank);
``input_pass_freed_bytes`` what is saved only after the last weight op. An op whose tensor
inputs are all parameters or made from them (a transpose, a cast) makes a parameter too.

Storages are keyed by identity, so one tensor (or several views of one storage) saved for two uses
counts once. Parameters and buffers are not activations and are never counted. Bytes are the
storage's bytes at the dtype it was created in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["SavedRecorder", "SavedTotals", "storage_key"]

_aten = torch.ops.aten
# Matmuls whose two operands may both be activations (attention's q k^T and probs @ v).
_MATMULS = {_aten.mm: (0, 1), _aten.bmm: (0, 1), _aten.baddbmm: (1, 2), _aten.addmm: (1, 2)}
# Matmuls a linear layer runs (its weight, a parameter, one operand).
_WEIGHT_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default}


def storage_key(tensor: torch.Tensor) -> int:
    """An identity for the storage behind ``tensor`` (views of one storage share it)."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):
        return id(tensor)


def _storage_nbytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, AttributeError):
        return tensor.numel() * tensor.element_size()


@dataclass(slots=True)
class _Saved:
    nbytes: int
    tag: str
    sharded: bool
    only_core: bool
    by_linear: bool = False
    by_other: bool = False
    weight_ops_before: int = 0  # the tag's weight ops dispatched when first saved


@dataclass(slots=True)
class _WeightOut:
    key: int
    nbytes: int
    made_sharded: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedTotals:
    """Saved bytes of one tag (one layer), storages de-duplicated.

    Attributes:
        total_bytes: everything saved for backward.
        replicated_bytes: the part tensor parallelism does not shard.
        core_bytes: the part saved only by the attention core (dropped by selective recompute).
        core_replicated_bytes: the replicated part of ``core_bytes``.
        op_sac_bytes: outputs per-op selective checkpointing keeps (module docstring), the
            layer's input not included.
        op_sac_replicated_bytes: the replicated part of ``op_sac_bytes``.
        swiglu_bytes: the saved outputs of ``aten.silu`` (module docstring).
        kv_repeat_bytes: the saved bytes of repeated K/V beyond one copy (module docstring).
        linear_bytes, linear_replicated_bytes: saved only as weight-matmul inputs (module
            docstring), and its replicated part.
        linear_shared_bytes, linear_shared_replicated_bytes: saved as a weight-matmul input
            and by another op, and its replicated part.
        norm_bytes, norm_replicated_bytes: kept by composite norms beyond a fused kernel's
            input and statistics (module docstring), and its replicated part.
        combine_bytes, combine_replicated_bytes: sources kept by ``index_add`` (module
            docstring), and its replicated part.
        weight_grad_bytes, weight_grad_replicated_bytes, weight_grad_reduced_bytes: the
            outputs of the weight ops (module docstring), the part tp does not shard, and the
            part neither tp nor sequence parallelism shards.
        input_pass_freed_bytes, input_pass_freed_replicated_bytes: saved only after the last
            weight op (module docstring), and its replicated part.
    """

    total_bytes: int
    replicated_bytes: int
    core_bytes: int
    core_replicated_bytes: int
    op_sac_bytes: int = 0
    op_sac_replicated_bytes: int = 0
    swiglu_bytes: int = 0
    kv_repeat_bytes: int = 0
    linear_bytes: int = 0
    linear_replicated_bytes: int = 0
    linear_shared_bytes: int = 0
    linear_shared_replicated_bytes: int = 0
    norm_bytes: int = 0
    norm_replicated_bytes: int = 0
    combine_bytes: int = 0
    combine_replicated_bytes: int = 0
    weight_grad_bytes: int = 0
    weight_grad_replicated_bytes: int = 0
    weight_grad_reduced_bytes: int = 0
    input_pass_freed_bytes: int = 0
    input_pass_freed_replicated_bytes: int = 0


@dataclass(slots=True)
class _NormScope:
    """One norm module's call: its input and the storages first saved inside it."""

    tag: str
    input_bytes: int
    rows: int
    new: list[int]


class SavedRecorder(TorchDispatchMode):
    """Record saved tensors by storage; propagate the sharded and core properties through ops.

    Args:
        excluded: tensors that are not activations (parameters, buffers); storages compared.
        sharded_params: parameters tensor parallelism shards (their products are sharded).
        fused_rms_norm: run ``F.rms_norm`` as the fused GPU kernel while recording (what it
            saves: input and fp32 1/rms); False keeps torch's composite, as CPU runs it.
    """

    def __init__(
        self,
        excluded: Iterable[torch.Tensor],
        sharded_params: Iterable[torch.Tensor],
        *,
        fused_rms_norm: bool = True,
    ) -> None:
        super().__init__()
        self.fused_rms_norm = fused_rms_norm
        # Every tensor whose storage key is remembered is kept alive here, so no other storage
        # can be allocated at its address and inherit its key.
        self._alive: list[torch.Tensor] = [*excluded, *sharded_params]
        self._excluded = {storage_key(t) for t in excluded}
        self._params = {storage_key(t) for t in excluded if getattr(t, "requires_grad", False)}
        self._weight_ops: dict[str, list[_WeightOut]] = {}
        # the last weight op's outputs: saved after it dispatched, they are still its own
        self._weight_outputs: set[int] = set()
        self._sharded = {storage_key(t) for t in sharded_params}
        self._core: set[int] = set()
        self._core_inputs: set[int] | None = None
        self._saved: dict[int, _Saved] = {}
        self.tag = ""
        self.forward_active = True
        self.core_fwd_flops: dict[str, int] = {}
        # Per-op selective checkpointing: tag -> storage -> bytes kept; FLOPs re-run; mm count.
        self._op_kept: dict[str, dict[int, int]] = {}
        self.op_sac_recompute_flops: dict[str, int] = {}
        self._mm_count: dict[str, int] = {}
        self._silu: set[int] = set()  # storages that aten.silu produced
        self._repeats: dict[int, int] = {}  # storages of materialised broadcasts -> factor
        self._recent: list[int] = []  # storages packed since the last dispatched op
        self._norm: _NormScope | None = None  # the norm module running now
        self._norm_depth = 0  # norm modules running, nested ones included
        self._norms: list[_NormScope] = []
        self._combine: set[int] = set()  # storages index_add kept as its source

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (shared inputs, parameters seen as fakes)."""
        tensors = list(tensors)
        self._alive.extend(tensors)
        self._excluded.update(storage_key(t) for t in tensors)

    # -- saved tensors -------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The pack hook: note the tensor's storage, return the tensor unchanged."""
        key = storage_key(tensor)
        if key in self._excluded:
            return tensor
        in_core = self._core_inputs is not None and key not in self._core_inputs
        is_core = in_core or key in self._core
        if in_core and self.forward_active:  # the fused attention kernel's own outputs
            self._op_kept.setdefault(self.tag, {})[key] = _storage_nbytes(tensor)
        entry = self._saved.get(key)
        if entry is None:
            self._alive.append(tensor)
            ops = len(self._weight_ops.get(self.tag, ())) - (key in self._weight_outputs)
            entry = _Saved(_storage_nbytes(tensor), self.tag, key in self._sharded, is_core,
                           weight_ops_before=ops)
            self._saved[key] = entry
            if self._norm is not None:
                self._norm.new.append(key)
        else:
            entry.sharded = entry.sharded or key in self._sharded
            entry.only_core = entry.only_core and is_core
        self._recent.append(key)
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        """The unpack hook (identity)."""
        return tensor

    @contextlib.contextmanager
    def attention_core(self, inputs: tuple) -> Iterator[None]:
        """While active, tensors saved (other than ``inputs``) belong to the attention core."""
        previous = self._core_inputs
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        self._alive.extend(tensors)
        self._core_inputs = {storage_key(t) for t in tensors}
        try:
            yield
        finally:
            self._core_inputs = previous

    def begin_norm(self, inputs: tuple) -> None:
        """A norm module's call starts (graph/measure.py's hooks): storages first saved until
        its ``end_norm`` belong to it (module docstring); a nested norm belongs to the outer."""
        self._norm_depth += 1
        tensor = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
        if self._norm_depth > 1 or tensor is None or not self.forward_active:
            return
        self._alive.append(tensor)
        rows = tensor.numel() // max(1, tensor.shape[-1]) if tensor.dim() else 1
        self._norm = _NormScope(self.tag, tensor.numel() * tensor.element_size(), rows, [])

    def end_norm(self) -> None:
        """The norm module's call that ``begin_norm`` opened ends."""
        self._norm_depth = max(0, self._norm_depth - 1)
        if self._norm_depth == 0 and self._norm is not None:
            self._norms.append(self._norm)
            self._norm = None

    def _norm_totals(self, tag: str) -> tuple[int, int]:
        """(bytes, replicated part) composite norms of ``tag`` keep beyond fused kernels."""
        total = replicated = 0
        for scope in (s for s in self._norms if s.tag == tag):
            new = [(k, self._saved[k]) for k in scope.new]
            kept = sum(e.nbytes for _, e in new)
            extra = kept - scope.input_bytes - 8 * scope.rows  # a fused kernel's input, stats
            if extra <= 0 or not kept:
                continue
            rep = sum(e.nbytes for _, e in new if not e.sharded)
            total += extra
            replicated += extra * rep // kept
        return total, replicated

    def clear_sharded(self, tensors: Any) -> None:
        """Mark ``tensors`` (a pytree) as reduced over tp: replicated from here on."""
        for leaf in tree_flatten(tensors)[0]:
            if isinstance(leaf, torch.Tensor):
                self._alive.append(leaf)
                self._sharded.discard(storage_key(leaf))

    def totals(self, tag: str) -> SavedTotals:
        """Sum the storages first saved under ``tag``."""
        entries = [e for e in self._saved.values() if e.tag == tag]
        silu = [e for k, e in self._saved.items() if e.tag == tag and k in self._silu]
        only = [e for e in entries if e.by_linear and not e.by_other]
        shared = [e for e in entries if e.by_linear and e.by_other]
        kept = self._op_kept.get(tag, {})
        norm = self._norm_totals(tag)
        combine = [e for k, e in self._saved.items() if e.tag == tag and k in self._combine]
        outs = self._weight_ops.get(tag, [])
        tail = [e for e in entries if e.weight_ops_before == len(outs)]
        return SavedTotals(
            total_bytes=sum(e.nbytes for e in entries),
            replicated_bytes=sum(e.nbytes for e in entries if not e.sharded),
            core_bytes=sum(e.nbytes for e in entries if e.only_core),
            core_replicated_bytes=sum(e.nbytes for e in entries if e.only_core and not e.sharded),
            op_sac_bytes=sum(kept.values()),
            op_sac_replicated_bytes=sum(n for k, n in kept.items() if k not in self._sharded),
            swiglu_bytes=sum(e.nbytes for e in silu),
            kv_repeat_bytes=sum(e.nbytes - e.nbytes // self._repeats[k]
                                for k, e in self._saved.items()
                                if e.tag == tag and k in self._repeats),
            linear_bytes=sum(e.nbytes for e in only),
            linear_replicated_bytes=sum(e.nbytes for e in only if not e.sharded),
            linear_shared_bytes=sum(e.nbytes for e in shared),
            linear_shared_replicated_bytes=sum(e.nbytes for e in shared if not e.sharded),
            norm_bytes=norm[0],
            norm_replicated_bytes=norm[1],
            combine_bytes=sum(e.nbytes for e in combine),
            combine_replicated_bytes=sum(e.nbytes for e in combine if not e.sharded),
            weight_grad_bytes=sum(o.nbytes for o in outs),
            weight_grad_replicated_bytes=sum(o.nbytes for o in outs if o.key not in self._sharded),
            weight_grad_reduced_bytes=sum(o.nbytes for o in outs
                                          if o.made_sharded and o.key not in self._sharded),
            input_pass_freed_bytes=sum(e.nbytes for e in tail),
            input_pass_freed_replicated_bytes=sum(e.nbytes for e in tail if not e.sharded),
        )

    # -- property propagation ------------------------------------------------------------------
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        keys = [storage_key(t) for t in inputs]
        sharded = any(k in self._sharded for k in keys)
        core = any(k in self._core for k in keys)
        if self.forward_active:
            self._note_weight_op(func, keys, out, sharded)
        if self._recent:
            if func is _aten.index_add.default and storage_key(args[3]) in self._recent:
                self._combine.add(storage_key(args[3]))
            self._attribute_packs(func, keys)
        if self.forward_active and self._is_activation_matmul(func, args):
            # q k^T starts the core; probs @ v (one operand already core) ends it.
            flops = int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
            self.core_fwd_flops[self.tag] = self.core_fwd_flops.get(self.tag, 0) + flops
            self._op_recompute(flops)
            core = not core
        elif self.forward_active and func is _aten.mm.default:
            self._op_policy_mm(args, kwargs, out, keys)
        elif func is _aten.silu.default and isinstance(out, torch.Tensor):
            self._alive.append(out)
            self._silu.add(storage_key(out))
        elif func is _aten.clone.default and isinstance(out, torch.Tensor):
            self._note_repeat(args[0], out)
        if sharded or core:
            for leaf in tree_flatten(out)[0]:
                if isinstance(leaf, torch.Tensor):
                    self._alive.append(leaf)
                    key = storage_key(leaf)
                    if sharded:
                        self._sharded.add(key)
                    if core:
                        self._core.add(key)
        return out

    def _attribute_packs(self, func: Any, keys: list[int]) -> None:
        """The packs since the last op: a weight matmul's activation operands (one pack each)
        are a linear's, every other pack another op's (module docstring)."""
        weights = func in _WEIGHT_MATMULS and any(k in self._excluded for k in keys)
        operands = {k for k in keys if k not in self._excluded} if weights else set()
        for key in self._recent:
            entry = self._saved[key]
            if key in operands:
                entry.by_linear = True
                operands.discard(key)
            else:
                entry.by_other = True
        self._recent = []

    def _note_weight_op(self, func: Any, keys: list[int], out: Any, sharded: bool) -> None:
        """A weight op's first output (its gradient awaits the weight pass; module docstring),
        or an op of parameters only, whose outputs are parameters too."""
        if not any(k in self._params for k in keys):
            return
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if all(k in self._params or k in self._excluded for k in keys):
            self._alive.extend(outs)
            self._params.update(storage_key(t) for t in outs)
            return
        if func.overloadpacket in (_aten.detach, _aten.alias) or not outs:
            return
        first = outs[0]
        self._alive.extend(outs)
        self._weight_outputs = {storage_key(t) for t in outs}
        self._weight_ops.setdefault(self.tag, []).append(_WeightOut(
            storage_key(first), first.numel() * first.element_size(), sharded))

    def _note_repeat(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """A clone of a broadcast view: ``out`` repeats ``source``'s elements this many times."""
        factor = 1
        for size, stride in zip(source.shape, source.stride(), strict=True):
            if stride == 0 and size > 1:
                factor *= size
        if factor > 1:
            self._alive.append(out)
            self._repeats[storage_key(out)] = factor

    def _op_recompute(self, flops: int) -> None:
        self.op_sac_recompute_flops[self.tag] = self.op_sac_recompute_flops.get(self.tag, 0) + flops

    def _op_policy_mm(self, args: tuple, kwargs: dict, out: Any, keys: list[int]) -> None:
        """torchtitan's per-op policy on a weight matmul: keep the odd-numbered outputs."""
        if not any(k in self._excluded for k in keys):
            return
        count = self._mm_count.get(self.tag, 0) + 1
        self._mm_count[self.tag] = count
        if count % 2:
            self._alive.append(out)
            self._op_kept.setdefault(self.tag, {})[storage_key(out)] = _storage_nbytes(out)
        else:
            self._op_recompute(int(flop_registry[_aten.mm](*args, **kwargs, out_val=out)))

    def _is_activation_matmul(self, func: Any, args: tuple) -> bool:
        operands = _MATMULS.get(func.overloadpacket)
        if operands is None:
            return False
        pair = [args[i] for i in operands]
        return all(
            isinstance(t, torch.Tensor) and t.requires_grad and storage_key(t) not in self._excluded
            for t in pair
        )
