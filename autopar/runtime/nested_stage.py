"""Decoder models whose blocks sit below the root (``model.layers``, ``transformer.h``): their
structure, and their pipeline stages.

The blocks are the profile's (``graph.structure.find_blocks``: the largest ModuleList/ModuleDict of
alike children). The outer modules are the siblings of the container and of its ancestors: those
registered before the path to the blocks form the embedding layer (``model.embed_tokens``,
``transformer.wte``, ``transformer.wpe``), those after it the head (``model.norm``, ``lm_head``).
Modules without parameters (rotary embedding, dropout) belong to no layer and stay on every stage.

Such a model's forward (a Hugging Face causal LM, nanoGPT) cannot skip absent parts, so a stage
runs the model's own forward on a copy whose parts outside the stage are stand-ins:

* not owning the embedding: each ``nn.Embedding`` before the blocks returns zeros (other modules
  there become ``nn.Identity``); the stage input (the previous stage's hidden states) replaces the
  hidden states its first block receives (a forward pre-hook), and the model is called on dummy
  token ids of the same batch and sequence shape, so positions, rotary tables and the causal mask
  are made exactly as in the full model;
* not owning the head: the final norm and lm head become pass-through stand-ins, and the stage's
  output is what reaches the lm head's stand-in: the last block's hidden states, whatever the
  model does to its logits after the head (Gemma 2 caps them with a tanh);
* blocks the stage does not own: dropped from the container, unless the model's forward numbers
  its blocks as it runs them (``for i, layer in enumerate(self.layers)``, most Hugging Face
  decoders: ``config.layer_types[i]`` picks each layer's mask, full or sliding window). Then
  they stay in place as pass-through stand-ins (``_SkippedBlock``), so the stage's blocks get
  their own index and mask.

Nothing is copied but the registries along the path to the blocks; FQNs stay the full model's.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopar.errors import AutoparError

if TYPE_CHECKING:
    from autopar.plan import StagePlan
    from autopar.runtime.pipeline_parallel import ModelStructure

__all__ = ["nested_parts", "shard_head_stand_ins", "split_nested_stage"]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def nested_parts(model: nn.Module) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """``(container, before, after)``: the block container's FQN and the outer modules with
    parameters registered before / after the path to it.

    Raises:
        AutoparError: no block container, no token embedding before the blocks, or another block
            stack outside them (an encoder): the reason, naming the part.
    """
    from autopar.graph.structure import find_blocks

    container, _blocks = find_blocks(model)
    if not container:
        raise AutoparError(
            "it has no block container (no nn.ModuleList/ModuleDict of alike blocks)"
        )
    before: list[str] = []
    levels_after: list[list[str]] = []
    node, prefix = model, ""
    for name in container.split("."):
        names = [n for n, m in node._modules.items() if m is not None]
        index = names.index(name)
        levels_after.append([])
        for position, child in enumerate(names):
            if position != index and _has_params(node._modules[child]):
                (before if position < index else levels_after[-1]).append(prefix + child)
        node, prefix = node._modules[name], f"{prefix}{name}."
    # The head runs inside out: the inner model's final norm before the root's lm head.
    after = [fqn for level in reversed(levels_after) for fqn in level]
    # An lm head registered before the blocks (nanoGPT-style code that ties it by assigning
    # its weight to the embedding) still runs last: a linear onto the vocabulary is the head.
    vocab = next((m.num_embeddings for f in before for m in model.get_submodule(f).modules()
                  if isinstance(m, nn.Embedding)), 0)
    heads = [f for f in before if isinstance(model.get_submodule(f), nn.Linear)
             and model.get_submodule(f).out_features == vocab]
    before = [f for f in before if f not in heads]
    after += heads
    _check_decoder(model, container, before, after)
    return container, tuple(before), tuple(after)


def _check_decoder(model: nn.Module, container: str, before: list[str], after: list[str]) -> None:
    from autopar.graph.structure import find_blocks

    for fqn in before + after:
        inner, inner_blocks = find_blocks(model.get_submodule(fqn))
        if len(inner_blocks) > 1:
            raise AutoparError(
                f"besides its blocks at {container!r} it runs another block stack at "
                f"'{fqn}.{inner}', and pipeline stages pass only one hidden state between blocks"
            )
    embeddings = [f for f in before if any(
        isinstance(m, nn.Embedding) for m in model.get_submodule(f).modules())]
    if not embeddings:
        raise AutoparError(
            f"its blocks at {container!r} have no token embedding (nn.Embedding) before them: "
            "autopar splits language models (token embedding, blocks, head) over tp and pp"
        )


class _NoEmbedding(nn.Module):
    """Stands in for an embedding a stage does not own: zeros of the embedding's output shape."""

    autopar_stand_in = True  # not the model's module: tensor parallelism leaves it alone

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        # Models that read the embedding's device or dtype off its weight (transformers'
        # Llama 4: ``input_ids.to(self.embed_tokens.weight.device)``) find an empty one.
        self.register_buffer("weight", torch.empty(0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, device=ids.device)


class _Absent(nn.Module):
    """Stands in for an outer module a stage does not own (the head on earlier stages).

    It passes its input through. With sequence parallelism the hidden states are sequence shards:
    the final norm's stand-in reads them as a ``Shard(1)`` DTensor, so whatever the model does
    with the whole sequence's shape before the lm head (GPT-2's ``view(-1, s, h)``) sees it, and
    the lm head's stand-in turns them back into the local shard the next stage receives.
    """

    autopar_stand_in = True

    def __init__(self) -> None:
        super().__init__()
        self.seq_mesh: Any = None
        self.to_dtensor = False
        self.capture: dict[str, Any] | None = None  # the lm head's: the stage's output slot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._pass(x)
        if self.capture is not None:
            self.capture["out"] = out
        return out

    def _pass(self, x: torch.Tensor) -> torch.Tensor:
        if self.seq_mesh is None:
            return x
        from torch.distributed.tensor import DTensor, Shard

        if self.to_dtensor and not isinstance(x, DTensor):
            return DTensor.from_local(x, self.seq_mesh, (Shard(1),), run_check=False)
        if not self.to_dtensor and isinstance(x, DTensor):
            return x.to_local()
        return x


class _SkippedBlock(nn.Module):
    """Stands in for a block another stage runs: it hands the hidden states on unchanged."""

    autopar_stand_in = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs["hidden_states"]


def _numbers_blocks(model: nn.Module, container: str) -> bool:
    """Whether the forward of the container's parent enumerates the blocks (module docstring),
    each call's result being the new hidden states (``hidden_states = layer(...)``).

    Raises:
        AutoparError: it enumerates them, its blocks return tuples, and its layers differ in
            type (``config.layer_types``): the stand-ins could not keep their masks.
    """
    import inspect
    import re

    parent_fqn, _, leaf = container.rpartition(".")
    parent = model.get_submodule(parent_fqn) if parent_fqn else model
    try:
        source = inspect.getsource(type(parent).forward)
    except (OSError, TypeError):
        return False
    loop = re.search(rf"for\s+\w+\s*,\s*(\w+)\s+in\s+enumerate\(self\.{leaf}\b", source)
    if not loop:
        return False
    if re.search(rf"hidden_states\s*=\s*{loop.group(1)}\(", source):
        return True
    kinds = set(getattr(getattr(model, "config", None), "layer_types", None) or ())
    if len(kinds) > 1:
        raise AutoparError(
            f"{type(parent).__name__} picks each block's mask by its index ({sorted(kinds)}) and "
            "its blocks return tuples, which pipeline stages cannot stand in for; use pp=1")
    return False


def _stand_in(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Embedding):
        return _NoEmbedding(module.embedding_dim)
    return _Absent()


def _shallow(module: nn.Module) -> nn.Module:
    part = copy.copy(module)
    # Fresh registries: the shallow copy would otherwise share the dicts with ``module``.
    part._modules = dict(module._modules)
    part._parameters = dict(module._parameters)
    part._buffers = dict(module._buffers)
    return part


def _set(root: nn.Module, fqn: str, module: nn.Module) -> None:
    parent, _, leaf = fqn.rpartition(".")
    (root.get_submodule(parent) if parent else root)._modules[leaf] = module


def split_nested_stage(
    model: nn.Module,
    stage: StagePlan,
    structure: ModelStructure,
    owned: list[str],
    *,
    seq_shards: int = 1,
) -> nn.Module:
    """The stage module of a nested-container model (see the module docstring).

    Args:
        model: the full model (not modified; its submodules are shared, not copied).
        stage: the stage's plan.
        structure: ``find_structure(model)`` (nested).
        owned: the container keys of the stage's blocks.
        seq_shards: how many pieces the sequence of the hidden states between stages is cut
            into (tp with sequence parallelism, else 1).

    Returns:
        A copy of the root whose forward takes token ids (first stage) or hidden states and returns
        logits (last stage) or hidden states.
    """
    first, last = stage.layers
    num_blocks = len(structure.block_keys)
    part = _shallow(model)
    node = part
    path = structure.container.split(".")
    for name in path[:-1]:
        node._modules[name] = _shallow(node._modules[name])
        node = node._modules[name]
    source = node._modules[path[-1]]
    blocks = type(source)() if isinstance(source, nn.ModuleList) else nn.ModuleDict()
    if _numbers_blocks(model, structure.container):
        blocks._modules = {key: block if key in owned else _SkippedBlock()
                           for key, block in source._modules.items()}
    else:
        blocks._modules = {key: source._modules[key] for key in owned}
    node._modules[path[-1]] = blocks
    if first > 0:
        for fqn in structure.before:
            _set(part, fqn, _stand_in(model.get_submodule(fqn)))
    slot: dict[str, torch.Tensor | None] = {"hidden": None, "out": None}
    if last < num_blocks + 1:
        for fqn in structure.after:
            _set(part, fqn, _Absent())
        head = part.get_submodule(structure.after[-1])
        assert isinstance(head, _Absent)
        head.capture = slot
    if first > 0:
        # The first module of the stage that takes the hidden states: its first block, or on a
        # head-only stage the head's first module (the final norm).
        entry = blocks._modules[owned[0]] if owned else model.get_submodule(structure.after[0])
        entry.register_forward_pre_hook(functools.partial(_swap_hidden, slot), with_kwargs=True)
    # The hidden states are sequence-sharded after the model's first block (layer 1) only.
    shards = 0 if first == 0 else seq_shards if first > 1 else 1
    original = type(model).forward.__get__(part)
    part.forward = functools.partial(
        _stage_forward, original, slot, shards, last < num_blocks + 1
    )
    return part


def shard_head_stand_ins(part: nn.Module, structure: ModelStructure, tp_mesh: Any) -> None:
    """With sequence parallelism: the head's stand-ins on a stage without the head carry the
    sequence shards as a DTensor from the final norm's place to the lm head's (see ``_Absent``)."""
    absent = [m for f in structure.after if isinstance(m := part.get_submodule(f), _Absent)]
    if len(absent) < 2:
        return
    for module in (absent[0], absent[-1]):
        module.seq_mesh = tp_mesh
    absent[0].to_dtensor = True


def _swap_hidden(
    slot: dict[str, Any], _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    # The stage's input replaces the (zero) hidden states the model made from dummy ids.
    hidden = slot["hidden"]
    if hidden is None:
        return None
    slot["hidden"] = None
    if args and isinstance(args[0], torch.Tensor):
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _stage_forward(
    original: Callable[..., Any],
    slot: dict[str, Any],
    seq_shards: int,
    returns_hidden: bool,
    x: torch.Tensor,
) -> torch.Tensor:
    # seq_shards == 0: the stage takes token ids; else hidden states cut into that many pieces.
    rows = x.shape[0]
    if seq_shards:
        slot["hidden"] = x
        x = torch.zeros((rows, x.shape[1] * seq_shards), dtype=torch.long, device=x.device)
    out = original(x)
    if returns_hidden and slot["out"] is not None:  # what reached the lm head's stand-in
        out, slot["out"] = slot["out"], None
        if out._base is not None:  # a view (Hugging Face slices the hidden states before the
            out = out.clone()  # head): the split-backward schedules detach outputs in place
    elif not isinstance(out, torch.Tensor):
        logits = getattr(out, "logits", None)
        out = logits if isinstance(logits, torch.Tensor) else out[0]
    if returns_hidden and out.shape[0] != rows:
        raise AutoparError(
            f"the model reshaped the hidden states of a pipeline stage to {tuple(out.shape)} "
            f"(batch {rows} expected): its forward assumes the whole sequence after the blocks; "
            "run it without sequence parallelism when pp > 1"
        )
    return out
