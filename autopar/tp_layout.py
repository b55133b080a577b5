"""The tensor-parallel layout of a plan: each module's style, and the rule that derives it.

``TPStyle`` names a module's style as torch's ParallelStyles do; ``layout_of`` is the rule (the
column- and row-parallel linears of each layer's structure, fused q/k/v split per projection,
norms sequence-parallel with SP, the vocab-parallel embedding and head), shared by the search
(``search.layout``, from a profile) and the runtime (from the modules, for a plan without one);
``collapse_patterns`` writes it compactly ("layers.*.attention.wq").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import Enum
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.graph.types import TPStructure

__all__ = ["TPStyle", "collapse_patterns", "layout_of"]


class TPStyle(str, Enum):
    """Tensor-parallel style of a module, named as torch's ParallelStyles."""

    COLWISE = "colwise"
    # A column-parallel fused q/k/v projection: each of q, k and v split over the ranks, a rank's
    # heads of the three kept together (a plain column split would hand one rank all of q).
    COLWISE_QKV = "colwise_qkv"
    ROWWISE = "rowwise"
    SEQUENCE = "sequence"
    REPLICATE = "replicate"


_INDEXED = re.compile(r"^(?P<prefix>.*?)\.(?P<index>\d+)\.(?P<suffix>.+)$")


def layout_of(
    layers: Iterable[tuple[str, TPStructure]], *, sequence_parallel: bool
) -> dict[str, str]:
    """The layout of layers given as (kind, TPStructure): ``tp_layout``'s rule, for callers that
    read the structures from the modules without a profile (the runtime, for a plan without one).
    """
    exact: dict[str, str] = {}
    for kind, structure in layers:
        for fqn in structure.colwise:
            fused = fqn in structure.fused_qkv
            exact[fqn] = (TPStyle.COLWISE_QKV if fused else TPStyle.COLWISE).value
        for fqn in structure.rowwise:
            exact[fqn] = TPStyle.ROWWISE.value
        if sequence_parallel:
            for fqn in structure.sequence:
                exact[fqn] = TPStyle.SEQUENCE.value
        vocab_style = TPStyle.ROWWISE if kind == "embedding" else TPStyle.COLWISE
        for fqn in structure.vocab_parallel:
            exact[fqn] = vocab_style.value
    return collapse_patterns(exact)


def collapse_patterns(exact: dict[str, str]) -> dict[str, str]:
    """Replace "p.<i>.s" entries by "p.*.s" when every index i seen under "p" has the same style.

    A pattern is used only when it matches no listed FQN of another style, so the collapsed map
    assigns every listed FQN exactly the style it had.
    """
    indices: dict[str, set[int]] = {}
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for fqn, style in exact.items():
        match = _INDEXED.match(fqn)
        if match:
            prefix, index = match["prefix"], int(match["index"])
            indices.setdefault(prefix, set()).add(index)
            groups.setdefault((prefix, match["suffix"]), {})[index] = style
    out = dict(exact)
    for (prefix, suffix), members in sorted(groups.items()):
        styles = set(members.values())
        if len(members) < 2 or len(styles) != 1 or set(members) != indices[prefix]:
            continue
        pattern, style = f"{prefix}.*.{suffix}", styles.pop()
        if any(fnmatchcase(f, pattern) and s != style for f, s in exact.items()):
            continue
        for index in members:
            del out[f"{prefix}.{index}.{suffix}"]
        out[pattern] = style
    return dict(sorted(out.items()))
