"""Tensor-parallel styles torch does not ship: HF ``Conv1D`` linears, fused q/k/v, keyword inputs.

torch's ``ColwiseParallel`` / ``RowwiseParallel`` shard ``nn.Linear`` and ``nn.Embedding`` only, and
``PrepareModuleInput`` reads positional inputs only. Hugging Face decoders need three more things:

* ``ShardedProjection``: a column- or row-parallel linear that is an ``nn.Linear`` or HF's
  ``Conv1D`` (GPT-2: weight ``[in, out]``, so its column split is ``Shard(1)``), optionally a fused
  q/k/v projection. The weight is a DTensor (``Shard`` of the output or input features; a fused
  q/k/v weight ``_StridedShard(out, split_factor=3)``: each of q, k and v split over the ranks, so
  a rank holds ``[q_r; k_r; v_r]``, its heads of all three) and the forward runs on the local
  shards: a column-parallel input is replicated (its gradient all-reduced in backward, Megatron's
  "f"), a row-parallel output is all-reduced (or reduce-scattered along the sequence, "g") and its
  bias added after the reduction. The gradients are DTensors of the parameters' placements, so
  ``full_tensor()``, FSDP2 and DCP see the one-process parameter.
* ``PrepareHidden``: like ``PrepareModuleInput``, for a module's hidden states given positionally or
  as the ``hidden_states`` keyword (HF attention modules take keywords).
* ``GatherSequence``: a module run on the whole sequence under sequence parallelism (a mixture
  of experts): its input all-gathered, its output cut back to the rank's sequence shard.
* ``localize_fused_attention`` (``graph.fused_attention``, where the profiler asks the same of
  the traced attention): an attention module that splits its fused q/k/v output by a width
  attribute (GPT-2 ``split_size``, nanoGPT ``n_embd``) and counts heads by an attribute
  (``n_head``, ``num_heads``) gets the local values (``/ tp``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.graph.fused_attention import is_conv1d

__all__ = ["GatherSequence", "PrepareHidden", "ShardedProjection", "WidthNorm",
           "shard_head_params"]

# The fused projection computes q, k and v: three equal column groups.
QKV_GROUPS = 3


def _hidden_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | str | None:
    if args and isinstance(args[0], torch.Tensor):
        return 0
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states"
    return None


class PrepareHidden(ParallelStyle):
    """Convert a module's hidden-state input from ``input_layout`` to ``desired_layout``.

    The input is the first positional argument when it is a tensor, else the ``hidden_states``
    keyword. A local tensor is first read as a DTensor of ``input_layout`` (no communication).
    """

    def __init__(
        self, *, input_layout: Placement, desired_layout: Placement, use_local_output: bool = False
    ) -> None:
        super().__init__()
        self.input_layout = input_layout
        self.desired_layout = desired_layout
        self.use_local_output = use_local_output

    def _convert(self, x: torch.Tensor, mesh: Any) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
        if x.placements != (self.desired_layout,):
            x = x.redistribute(placements=(self.desired_layout,))
        return x.to_local() if self.use_local_output else x

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            where = _hidden_index(args, kwargs)
            if where == 0:
                args = (self._convert(args[0], device_mesh), *args[1:])
            elif where is not None:
                kwargs = {**kwargs, where: self._convert(kwargs[where], device_mesh)}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class GatherSequence(ParallelStyle):
    """A module that runs on the whole sequence under sequence parallelism (a mixture of
    experts, whose routed experts every tp rank holds whole): its hidden-state input, this
    rank's ``[b, s / tp, ...]`` shard, is all-gathered (``Shard(1) -> Replicate()``; the
    gradient, replicated, is cut back without communication) and its output, the same on every
    tp rank, is cut to this rank's shard (``Replicate() -> Shard(1)``: nothing forward, an
    all-gather of the gradient backward). A tuple output has its first element cut; an output
    flattened to ``[b s, h]`` (Llama 4) is cut as ``[b, s, h]`` and handed back flat."""

    def _gather(self, x: torch.Tensor, mesh: Any, seen: list[torch.Size]) -> torch.Tensor:
        whole = DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
        out = whole.redistribute(placements=(Replicate(),)).to_local()
        seen[:] = [out.shape]  # one slot: a recompute may stop before the output hook runs
        return out

    def _cut(self, out: Any, mesh: Any, shape: torch.Size) -> Any:
        if isinstance(out, tuple):
            return (self._cut(out[0], mesh, shape), *out[1:])
        if not isinstance(out, torch.Tensor) or out.dim() < 2:
            raise TypeError("a module that gathers the sequence must return its hidden states, "
                            f"not {type(out).__name__}")
        flat = out.dim() == 2 and out.shape[0] == shape[0] * shape[1]
        whole = DTensor.from_local(out.view(shape[0], shape[1], -1) if flat else out, mesh,
                                   (Replicate(),), run_check=False)
        # A copy, not the view DTensor hands back: decoders add to it in place (gpt-oss's
        # residual, Llama 4), which autograd forbids on a custom Function's view.
        mine = whole.redistribute(placements=(Shard(1),)).to_local().clone()
        return mine.view(-1, mine.shape[-1]) if flat else mine

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        seen: list[torch.Size] = []  # the gathered input's shape, for the output's cut

        def pre(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            where = _hidden_index(args, kwargs)
            if where == 0:
                args = (self._gather(args[0], device_mesh, seen), *args[1:])
            elif where is not None:
                kwargs = {**kwargs, where: self._gather(kwargs[where], device_mesh, seen)}
            else:
                raise TypeError(f"{type(_mod).__name__} takes no hidden states to gather")
            return args, kwargs

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(lambda _mod, _args, out: self._cut(out, device_mesh,
                                                                        seen[-1]))
        return module


class WidthNorm(ParallelStyle):
    """A norm over a column-parallel linear's whole output (OLMo 2's ``q_norm`` and ``k_norm``:
    all heads' features together), run on this rank's slice of them: its weights are sharded
    like the features (``Shard(0)``), its input read as ``Shard(-1)`` of the whole width, and
    the module's own forward runs on DTensors, whose mean over the sharded features all-reduces
    the statistics over tp (and the backward their gradient). The output is the local slice."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, device_mesh, (Shard(0),)), param.requires_grad))

        def pre(_mod: nn.Module, args: tuple[Any, ...]) -> Any:
            x = args[0]
            return (DTensor.from_local(x, device_mesh, (Shard(x.dim() - 1),), run_check=False),
                    *args[1:])

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(lambda _mod, _args, out: out.to_local())
        return module


def shard_head_params(module: nn.Module, names: list[str], mesh: Any) -> None:
    """Shard ``module``'s own per-head parameters (gpt-oss's ``sinks``) with its heads
    (``Shard(0)``) and let its forward read this rank's slice: a pre-hook puts the local
    tensor (autograd-connected to the DTensor parameter) in the instance's ``__dict__``, where
    attribute lookup finds it before the parameter. It stays there between forwards (a view of
    the parameter's local shard): a selective recompute re-runs the attention core in the
    backward, outside the module's forward, and reads it too."""
    for name in names:
        param = module._parameters[name]
        assert param is not None
        module._parameters[name] = nn.Parameter(
            distribute_tensor(param.detach(), mesh, (Shard(0),)), param.requires_grad)

    def pre(mod: nn.Module, _args: Any) -> None:
        for name in names:
            mod.__dict__[name] = mod._parameters[name].to_local()  # type: ignore[union-attr]

    module.register_forward_pre_hook(pre)


def _project(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The module's own matmul on local shards: F.linear, or Conv1D's addmm on weight [in, out].
    weight = module.weight.to_local()
    if not is_conv1d(module):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.mm(flat, weight) if bias is None else torch.addmm(bias, flat, weight)
    return out.view(*x.shape[:-1], weight.shape[-1])


def _colwise_forward(module: nn.Module, mesh: Any, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
    x = x.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),))
    bias = module.bias.to_local() if module.bias is not None else None
    return _project(module, x, bias)


def _rowwise_forward(
    module: nn.Module, mesh: Any, output_layout: Placement, x: torch.Tensor
) -> torch.Tensor:
    if isinstance(x, DTensor):
        x = x.redistribute(placements=(Shard(-1),)).to_local()
    partial = DTensor.from_local(_project(module, x, None), mesh, (Partial(),), run_check=False)
    y = partial.redistribute(placements=(output_layout,))
    if module.bias is not None:
        y = y + module.bias
    return y.to_local()


class ShardedProjection(ParallelStyle):
    """A column- or row-parallel ``nn.Linear`` / HF ``Conv1D`` computed on local shards.

    Args:
        rowwise: row-parallel (input features sharded, output reduced) instead of column-parallel.
        groups: column groups split separately (3 for a fused q/k/v projection; else 1).
        output_layout: a row-parallel output's layout: ``Replicate()`` (all-reduce) or
            ``Shard(1)`` (sequence parallelism: reduce-scatter).
    """

    def __init__(
        self, *, rowwise: bool, groups: int = 1, output_layout: Placement | None = None
    ) -> None:
        super().__init__()
        self.rowwise = rowwise
        self.groups = groups
        self.output_layout = output_layout or Replicate()

    def _placements(self, module: nn.Module) -> dict[str, Placement]:
        out_dim = 1 if is_conv1d(module) else 0
        if self.rowwise:
            return {"weight": Shard(1 - out_dim), "bias": Replicate()}
        if self.groups == 1:
            return {"weight": Shard(out_dim), "bias": Shard(0)}
        return {
            "weight": _StridedShard(out_dim, split_factor=self.groups),
            "bias": _StridedShard(0, split_factor=self.groups),
        }

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for name, placement in self._placements(module).items():
            param = getattr(module, name, None)
            if param is None:
                continue
            shard = distribute_tensor(param, device_mesh, [placement],
                                      src_data_rank=self.src_data_rank)
            module.register_parameter(
                name, nn.Parameter(shard, requires_grad=param.requires_grad)
            )
        if self.rowwise:
            forward = functools.partial(_rowwise_forward, module, device_mesh, self.output_layout)
        else:
            forward = functools.partial(_colwise_forward, module, device_mesh)
        module.forward = forward  # the instance's forward: hooks and FQNs stay the module's
        return module
