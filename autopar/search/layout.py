"""The tensor-parallel layout of a plan: module FQN -> torch ParallelStyle name.

Read from the profile's per-layer ``TPStructure`` (Megatron-LM's sharding, in torch's vocabulary):
linears listed as column-parallel -> "colwise", row-parallel -> "rowwise"; norms -> "sequence"
only with sequence parallelism; the vocabulary-parallel token embedding -> "rowwise" (torch's
``RowwiseParallel(input_layouts=Replicate())``) and the lm head -> "colwise". When every block
shares an entry, the blocks' FQNs collapse into one fnmatch pattern ("layers.*.attention.wq").
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase

from autopar.graph.types import ModelProfile
from autopar.plan import TPStyle

__all__ = ["collapse_patterns", "tp_layout"]

_INDEXED = re.compile(r"^(?P<prefix>.*?)\.(?P<index>\d+)\.(?P<suffix>.+)$")


def tp_layout(profile: ModelProfile, *, tp: int, sequence_parallel: bool) -> dict[str, str]:
    """Module FQN (or fnmatch pattern) -> TPStyle value; empty when tp == 1.

    Args:
        profile: the model profile (its layers' ``tp`` structures).
        tp: tensor-parallel degree.
        sequence_parallel: whether norms run sequence-parallel.
    """
    if tp <= 1:
        return {}
    exact: dict[str, str] = {}
    for layer in profile.layers:
        structure = layer.tp
        for fqn in structure.colwise:
            exact[fqn] = TPStyle.COLWISE.value
        for fqn in structure.rowwise:
            exact[fqn] = TPStyle.ROWWISE.value
        if sequence_parallel:
            for fqn in structure.sequence:
                exact[fqn] = TPStyle.SEQUENCE.value
        vocab_style = TPStyle.ROWWISE if layer.kind == "embedding" else TPStyle.COLWISE
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
