"""Sharded, atomic, verified training checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of a checkpoint directory::

    DIR/step_4/       a checkpoint: DCP shards + .metadata + MANIFEST.json (sha256 of each file)
    DIR/step_6.tmp/   a checkpoint being written (or left by a crash: ignored and replaced)

What is saved: the model and AdamW state of every model part this rank holds, through
``get_state_dict`` / ``set_state_dict`` with flattened optimizer keys (``state.<fqn>.exp_avg``,
``param_groups.<fqn>.lr``). Keys are the original model's FQNs, so a checkpoint written under one
split loads under any other (tp=2 -> dp=2, pp=2 -> one process): DCP reshards on load. Experts
sharded over ep ranks (one FQN, different experts per rank) are saved and loaded through
whole-tensor DTensor views of them (``expert_parallel.expert_state_views``).

Trust: DCP's ``.metadata`` is a pickle and its non-tensor items are ``torch.load``-ed with
``weights_only=False``; autopar reads both as data only (``dcp_data.py``: an unpickler that
builds DCP's metadata records and nothing else, ``weights_only=True``), so no checkpoint runs
code, even one whose manifest is forged. Before any ``dcp.load`` the checkpoint is checked
against its manifest (``manifest.py``): every file present, of the recorded size and sha256, and
no other file. A checkpoint without a manifest (not written by autopar) is loaded only with
``--trust-checkpoint``; a damaged newest checkpoint is skipped for the newest one that verifies.
Before launch, ``model_problem`` compares its metadata's FQNs and shapes with the model's.

Atomicity: every rank writes its shards into ``step_N.tmp/``; after a barrier the ranks hash
the files (each its share), rank 0 writes the manifest last (a temporary file, fsynced, then
renamed) and only then renames ``step_N.tmp/`` to ``step_N/``. A crash at any point leaves either
no ``step_N/`` or an earlier one, so the previous checkpoint stays the one resumed from. On
several nodes DIR must be on storage every node sees.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.runtime.manifest import (
    MANIFEST_NAME,
    ResumePoint,
    file_digests,
    find_resume_point,
    manifest_problem,
    write_manifest,
)

__all__ = [
    "MANIFEST_NAME",
    "ResumePoint",
    "check_checkpoint_dir",
    "checkpoint_path",
    "load_latest_checkpoint",
    "model_problem",
    "save_checkpoint",
]


def checkpoint_path(checkpoint_dir: str | Path, step: int) -> Path:
    """The directory of the checkpoint taken after optimizer step ``step``."""
    return Path(checkpoint_dir) / f"step_{step}"


def check_checkpoint_dir(
    checkpoint_dir: str | None, *, resume: bool, steps: int, every: int, trust: bool = False
) -> ResumePoint:
    """Check the checkpoint arguments of a launch; return the checkpoint training resumes from.

    Pure file-system inspection (no process group), so the launcher calls it before starting any
    worker; it reads every byte of the checkpoint it picks (the sha256 check).

    Args:
        checkpoint_dir: ``--checkpoint-dir`` (None: no checkpoints).
        resume: ``--resume``.
        steps: ``--steps``, the total.
        every: ``--checkpoint-every``.
        trust: ``--trust-checkpoint`` (load a checkpoint without a manifest).

    Returns:
        The ResumePoint (``step`` None for a fresh run); its ``note()`` says what was skipped.

    Raises:
        AutoparError: --resume, --checkpoint-every or --trust-checkpoint without what they need;
            --resume with no checkpoint that verifies; an existing non-empty directory without
            --resume (a run never overwrites checkpoints silently); a checkpoint past --steps.
    """
    if every < 0:
        raise AutoparError(f"--checkpoint-every must be 0 or more, got {every}")
    if trust and not resume:
        raise AutoparError(
            "--trust-checkpoint goes with --resume (it lets autopar load a checkpoint it did "
            "not write)"
        )
    if not checkpoint_dir:
        if resume:
            raise AutoparError("--resume needs --checkpoint-dir DIR (the run to continue)")
        if every:
            raise AutoparError("--checkpoint-every needs --checkpoint-dir DIR")
        return ResumePoint(step=None)
    root = Path(checkpoint_dir)
    if root.exists() and not root.is_dir():
        raise AutoparError(f"checkpoint dir {checkpoint_dir} is a file; give a directory")
    if not resume:
        if root.is_dir() and any(root.iterdir()):
            raise AutoparError(
                f"checkpoint dir {checkpoint_dir} already holds a run; pass --resume to continue "
                "it, or give a new --checkpoint-dir"
            )
        _check_creatable(root)
        return ResumePoint(step=None)
    return _resume_point(checkpoint_dir, steps=steps, trust=trust)


def _check_creatable(root: Path) -> None:
    """The workers can create (or write into) ``root``: found before training, not after it."""
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise AutoparError(f"checkpoint dir {root} cannot be created: {existing} is not a "
                           "directory; give another --checkpoint-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise AutoparError(f"checkpoint dir {root} cannot be written: {existing} is not "
                           "writable; give another --checkpoint-dir")


def model_problem(checkpoint_dir: str | Path, step: int,
                  state_shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why checkpoint ``step`` does not hold the state of the model with ``state_shapes`` (its
    state dict's FQNs and shapes, from a meta build), or None. Reads only the checkpoint's
    metadata, as data (``dcp_data``), so a run for another model is refused before launch."""
    from autopar.runtime.dcp_data import read_metadata_bytes

    path = checkpoint_path(checkpoint_dir, step)
    metadata = read_metadata_bytes((path / ".metadata").read_bytes())
    saved = {key.removeprefix("model."): tuple(getattr(value, "size", ()))
             for key, value in metadata.state_dict_metadata.items() if key.startswith("model.")}
    problems = [f"{fqn} is {list(saved[fqn])} there, {list(shape)} here"
                for fqn, shape in state_shapes.items()
                if fqn in saved and saved[fqn] != tuple(shape)]
    problems += [f"it lacks {fqn}" for fqn in state_shapes if fqn not in saved]
    problems += [f"it holds {fqn}, which this model lacks" for fqn in saved
                 if fqn not in state_shapes]
    if not problems:
        return None
    more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
    return (f"checkpoint {path} was written for another model ({'; '.join(problems[:3])}{more}); "
            "resume with the model that wrote it, or give a new --checkpoint-dir")


def _resume_point(checkpoint_dir: str, *, steps: int, trust: bool) -> ResumePoint:
    """The checkpoint ``--resume`` continues from (``check_checkpoint_dir``'s resume case)."""
    if not Path(checkpoint_dir).is_dir():
        raise AutoparError(
            f"checkpoint dir {checkpoint_dir} does not exist; nothing to resume (drop --resume "
            "to start a new run there)"
        )
    point = find_resume_point(checkpoint_dir, trust=trust)
    if point.step is None:
        raise AutoparError(point.refusal(checkpoint_dir))
    if point.step >= steps:  # at --steps: nothing left to train
        where = "past" if point.step > steps else "already at"
        raise AutoparError(
            f"the last checkpoint in {checkpoint_dir} is at step {point.step}, {where} --steps "
            f"{steps}; --steps is the total, so pass --steps {point.step + 1} or more to train on"
        )
    return point


def _optim_key(key: str, tied: tuple[str, str] | None) -> str:
    """The merged key of a flat optimizer entry: a tied head's copy (``tied_weights.py``) is
    stored under the embedding's name, as the one-process model (one weight) names its state."""
    if tied is not None:
        for section in ("state.", "param_groups."):
            if key.startswith(f"{section}{tied[1]}."):
                return f"optim.{section}{tied[0]}.{key[len(section) + len(tied[1]) + 1:]}"
    return f"optim.{key}"


def _merged_state(model_parts: Sequence[Any], optimizers: Sequence[Any],
                  tied: tuple[str, str] | None = None) -> tuple[dict, list, dict]:
    """One flat state dict over all model parts, the key sets of each part, and the entries
    replaced by views (expert-parallel experts as whole-tensor DTensors,
    ``expert_parallel.expert_state_views``) with the values they replaced.

    ``get_optimizer_state_dict`` creates the optimizer state if it does not exist yet (a zero-lr
    step), which DCP needs before it can load into it. ``tied``: the (embedding, head) FQNs of
    a weight tied across a pipeline split: the head copy's optimizer state is merged under the
    embedding's name (``_optim_key``; where one rank holds both copies, the two states are
    equal and the embedding's is the one saved and loaded).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from autopar.runtime.expert_parallel import expert_state_views

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    merged: dict[str, Any] = {}
    part_keys = []
    replaced: dict[str, Any] = {}
    for part, optimizer in zip(model_parts, optimizers, strict=True):
        model_sd, optim_sd = get_state_dict(part, optimizer, options=options)
        part_keys.append((tuple(model_sd), tuple(optim_sd)))
        for key, value in model_sd.items():
            merged[f"model.{key}"] = value
        for key, state in optim_sd.items():
            merged.setdefault(_optim_key(key, tied), state)
        for key, view in expert_state_views(part, model_sd, optim_sd).items():
            replaced[key], merged[key] = merged[key], view
    return merged, part_keys, replaced


def save_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    model_parts: Sequence[Any],
    optimizers: Sequence[Any],
    *,
    marker: dict[str, Any],
    tied: tuple[str, str] | None = None,
) -> Path:
    """Write the checkpoint of step ``step`` atomically, manifest last (collective).

    Args:
        checkpoint_dir: the run's checkpoint directory.
        step: optimizer steps completed.
        model_parts: the model chunks this rank holds (one per pipeline stage on the rank).
        optimizers: one optimizer per model part, in the same order.
        marker: JSON-ready facts recorded in the manifest (world size, config); ``step`` is
            added.
        tied: ``ParallelizedModel.tied.fqns`` where the pipeline split a tied weight.

    Returns:
        The path of the complete checkpoint.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = checkpoint_path(checkpoint_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        # A crash may have left partial writes (tmp dirs): none is a usable checkpoint.
        for stale in Path(checkpoint_dir).glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state, _, _ = _merged_state(model_parts, optimizers, tied)
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    digests = _shared_digests(tmp)
    if rank == 0:
        write_manifest(tmp, {**marker, "step": step}, digests)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    dist.barrier()
    return final


def _shared_digests(directory: Path) -> dict[str, str]:
    """sha256 of every file in ``directory``, each rank hashing its share (collective).

    The files are sorted and rank r hashes every world-size-th one from r, so the ranks together
    read the checkpoint once; every rank gets the merged table.
    """
    import torch.distributed as dist

    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    mine = file_digests(directory, names[dist.get_rank()::dist.get_world_size()])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {name: digest for part in gathered for name, digest in part.items()}


def _fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (POSIX; a no-op where directories can't be
    opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _agreed_problem(directory: Path) -> str | None:
    """``manifest_problem`` of ``directory`` over all ranks (collective): each rank hashes its
    share of the files and every rank gets the same answer (the first rank's reason)."""
    import torch.distributed as dist

    mine = manifest_problem(directory, rank=dist.get_rank(), world_size=dist.get_world_size())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return next((p for p in gathered if p is not None), None)


def load_latest_checkpoint(
    checkpoint_dir: str | Path,
    model_parts: Sequence[Any],
    optimizers: Sequence[Any],
    *,
    trust: bool,
    tied: tuple[str, str] | None = None,
) -> ResumePoint:
    """Load the newest checkpoint that verifies into this rank's parts and optimizers.

    Collective: every rank calls it. Each checkpoint is checked against its manifest before
    ``dcp.load`` reads it (the ranks share the hashing); one without a manifest is loaded only
    when ``trust``. The current split may differ from the one that saved (DCP reshards);
    ``tied`` as for ``save_checkpoint``.

    Returns:
        The ResumePoint (``step`` None: nothing loaded).
    """
    point = find_resume_point(checkpoint_dir, trust=trust, check=_agreed_problem)
    if point.step is not None:
        _load(checkpoint_path(checkpoint_dir, point.step), model_parts, optimizers, tied)
    return point


def _load(path: Path, model_parts: Sequence[Any], optimizers: Sequence[Any],
          tied: tuple[str, str] | None = None) -> None:
    """``dcp.load`` of the checked checkpoint ``path``, then each part's state set from it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from autopar.runtime.dcp_data import DataOnlyPlanner, DataOnlyReader

    state, part_keys, replaced = _merged_state(model_parts, optimizers, tied)
    # As data: the metadata's unpickler and the non-tensor items build nothing the checkpoint
    # names beyond DCP's own records (dcp_data.py).
    dcp.load(state, storage_reader=DataOnlyReader(path), planner=DataOnlyPlanner())
    state.update(replaced)  # the expert views were loaded in place, into these tensors
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    for part, optimizer, (model_keys, optim_keys) in zip(
        model_parts, optimizers, part_keys, strict=True
    ):
        # DCP replaces non-tensor entries (lr, betas, step counts) in ``state`` rather than
        # loading in place, so rebuild each part's dicts from the loaded merged dict.
        set_state_dict(
            part,
            optimizer,
            model_state_dict={k: state[f"model.{k}"] for k in model_keys},
            optim_state_dict={k: _loaded(state, k, tied) for k in optim_keys},
            options=options,
        )


def _loaded(state: dict[str, Any], key: str, tied: tuple[str, str] | None) -> Any:
    """The loaded value of a part's optimizer entry ``key``. A tied head copy's entry is read
    from the embedding's name (``_optim_key``), and copied: where one rank holds both copies the
    two parts read one merged entry, and an optimizer must not share its state tensors."""
    import torch

    merged = _optim_key(key, tied)
    value = state[merged]
    if merged != f"optim.{key}" and isinstance(value, torch.Tensor):
        return value.clone()
    return value
