"""Pipeline stages of models whose blocks sit below the root: a forward that numbers its blocks
as it runs them (``for i, layer in enumerate(self.layers)``, picking layer i's mask) keeps the
other stages' blocks as pass-through stand-ins, so each block keeps its index
(``nested_stage._numbers_blocks``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.runtime.nested_stage import _numbers_blocks, _SkippedBlock


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, hidden_states, mask=None):
        return self.linear(hidden_states)


class _Numbered(nn.Module):
    def __init__(self, kinds=("sliding", "full")) -> None:
        super().__init__()
        self.config = SimpleNamespace(layer_types=list(kinds))
        self.layers = nn.ModuleList(_Block() for _ in kinds)

    def forward(self, hidden_states):
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, mask=self.config.layer_types[i])
        return hidden_states


class _TupleBlocks(_Numbered):
    def forward(self, hidden_states):
        for i, layer in enumerate(self.layers):
            outputs = layer(hidden_states, mask=self.config.layer_types[i])
            hidden_states = outputs[0]
        return hidden_states


class _Plain(_Numbered):
    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


class _Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.model = inner


def test_a_forward_that_numbers_its_blocks_keeps_their_places():
    assert _numbers_blocks(_Numbered(), "layers")
    assert _numbers_blocks(_Outer(_Numbered()), "model.layers")
    assert not _numbers_blocks(_Plain(), "layers")


def test_tuple_blocks_of_differing_types_are_refused_with_the_reason():
    with pytest.raises(AutoparError, match="picks each block's mask by its index"):
        _numbers_blocks(_TupleBlocks(), "layers")
    assert not _numbers_blocks(_TupleBlocks(kinds=("full", "full")), "layers")


def test_a_skipped_block_hands_the_hidden_states_on():
    x = torch.randn(2, 3, 4)
    assert _SkippedBlock()(x, mask="full") is x
    assert _SkippedBlock()(hidden_states=x) is x
