"""A model's layer structure: the repeated blocks, and what runs before and after them.

The blocks are the children of the largest ``nn.ModuleList`` / ``nn.ModuleDict`` whose children are
all alike: of one class. Their insides may differ (DeepSeek-V3's first layers are dense and the
rest mixtures of experts, Llama 4 interleaves layers without rotary embeddings); each distinct
block is measured on its own. Every other module the model calls is *outside*: the
ones called before the first block make the ``embedding`` layer, the ones called after the last
block the ``head`` layer (final norm, lm head; the loss is computed there too). Blocks with the same
structure, parameter shapes and input shapes are repeats: measured once, shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["Structure", "find_blocks", "group_outside", "module_signature", "outside_unit"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Structure:
    """Which modules form which layer.

    Attributes:
        container: FQN of the ModuleList/ModuleDict holding the blocks ("" if none).
        blocks: FQNs of the blocks, in container order.
        embedding: FQNs of the outside modules called before the first block.
        head: FQNs of the outside modules first called after the last block.
    """

    container: str
    blocks: tuple[str, ...]
    embedding: tuple[str, ...] = ()
    head: tuple[str, ...] = ()


def module_signature(module: nn.Module) -> str:
    """Structure of a module without its name: printed form plus parameter and buffer shapes."""
    tensors = [
        f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}"
        for name, t in (*module.named_parameters(), *module.named_buffers())
    ]
    return f"{type(module).__qualname__}|{module!r}|{';'.join(tensors)}"


def find_blocks(model: nn.Module) -> tuple[str, tuple[str, ...]]:
    """The largest ModuleList/ModuleDict of alike modules.

    Args:
        model: the model.

    Returns:
        ``(container_fqn, block_fqns)``, or ``("", ())`` when the model has none.
    """
    best: tuple[int, int, str, tuple[str, ...]] | None = None
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) == 0:
            continue
        children = list(module.named_children())
        first = children[0][1]
        if not all(type(c) is type(first) for _, c in children):
            continue
        if isinstance(first, (nn.ModuleList, nn.ModuleDict)):
            continue
        size = sum(p.numel() for p in module.parameters())
        key = (len(children), size)
        if best is None or key > best[:2]:
            names = tuple(f"{fqn}.{name}" if fqn else name for name, _ in children)
            best = (len(children), size, fqn, names)
    if best is None:
        return "", ()
    return best[2], best[3]


def _ancestors(fqns: Sequence[str]) -> set[str]:
    result = {""}
    for fqn in fqns:
        parts = fqn.split(".")
        result.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return result


def outside_unit(fqn: str, blocks: frozenset[str], ancestors: set[str]) -> str | None:
    """The layer-level unit a module belongs to: a block FQN, an outside module, or None.

    The unit of a module is its outermost enclosing module that is not an ancestor of the blocks
    (the root and the block container are ancestors; ``model.embed_tokens`` is a unit).

    Args:
        fqn: FQN of a called module ("" for the root).
        blocks: the block FQNs.
        ancestors: FQNs of the blocks' ancestors (from ``_ancestors``).

    Returns:
        The unit's FQN, or None for the root and the blocks' ancestors themselves.
    """
    parts = fqn.split(".") if fqn else []
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in blocks or prefix not in ancestors:
            return prefix
    return None


def group_outside(container: str, blocks: Sequence[str], call_order: Sequence[str]) -> Structure:
    """Split the called outside modules into those before the first and after the last block.

    Args:
        container: FQN of the blocks' container.
        blocks: block FQNs.
        call_order: FQNs of modules in the order they were first called (any depth).

    Returns:
        The Structure.
    """
    block_set = frozenset(blocks)
    ancestors = _ancestors(blocks) | ({container} if container else set())
    units: list[str] = []
    for fqn in call_order:
        unit = outside_unit(fqn, block_set, ancestors)
        if unit is not None and unit not in units:
            units.append(unit)
    positions = [i for i, u in enumerate(units) if u in block_set]
    if not positions:
        return Structure(container=container, blocks=tuple(blocks), embedding=tuple(units))
    first, last = positions[0], positions[-1]
    return Structure(
        container=container,
        blocks=tuple(blocks),
        embedding=tuple(u for u in units[:first] if u not in block_set),
        head=tuple(u for u in units[last + 1 :] if u not in block_set),
    )
