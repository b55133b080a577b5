"""The runtime's live-tensor counter follows in-place storage resizes (FSDP2's free/re-gather)."""

from __future__ import annotations

import torch

from autopar.runtime.worker import LiveTensorBytes


def test_counter_follows_storage_resize_and_restores_torch() -> None:
    original = torch.UntypedStorage.resize_
    tracker = LiveTensorBytes()
    with tracker:
        x = torch.empty(1024, dtype=torch.float32)  # 4 KiB
        assert tracker.current_bytes == 4096
        x.untyped_storage().resize_(0)  # FSDP2 frees unsharded parameters this way
        assert tracker.current_bytes == 0
        x.untyped_storage().resize_(4096)  # ... and re-allocates them for the next all-gather
        assert tracker.current_bytes == 4096
        y = torch.ones(256)  # 1 KiB more
        assert tracker.peak_bytes == 4096 + 1024
        del x, y
        assert tracker.current_bytes == 0
    assert torch.UntypedStorage.resize_ is original


def test_storages_created_outside_are_not_counted() -> None:
    outside = torch.empty(1024)
    tracker = LiveTensorBytes()
    with tracker:
        outside.untyped_storage().resize_(0)
        assert tracker.current_bytes == 0
