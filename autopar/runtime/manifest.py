"""Checkpoint manifests: the sha256 of every file of a checkpoint, checked before it is loaded.

Loading a DCP checkpoint unpickles its ``.metadata`` (and ``torch.load``s its non-tensor items
with ``weights_only=False``), so a checkpoint is code as much as data. autopar therefore loads
only checkpoints it wrote itself and that are intact:

- ``write_manifest`` records, for every file of a finished checkpoint directory, its size in
  bytes and its sha256; it writes ``MANIFEST.json`` last, through a temporary file, fsynced and
  renamed (atomic on POSIX).
- ``manifest_problem`` checks a directory against its manifest: every listed file present with
  its size and hash, no file the manifest does not list. Hashing can be shared among ranks.
- ``find_resume_point`` picks the newest checkpoint that verifies, noting each newer one it
  skipped; a checkpoint without a manifest (written by someone else, or an older autopar) is
  loaded only when the user trusts it (``--trust-checkpoint``), and then unverified.

The manifest proves that a checkpoint is complete and unchanged since it was written; it is not
a signature (whoever can write the directory can write a manifest). Pure file-system code: no
process group.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from autopar.units import MIB

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "NOT_AUTOPAR",
    "ResumePoint",
    "checkpoint_steps",
    "file_digests",
    "find_resume_point",
    "manifest_problem",
    "write_manifest",
]

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "autopar-checkpoint/1"
# The reason given for a checkpoint without a manifest that holds DCP files.
NOT_AUTOPAR = "no manifest: not written by autopar"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A manifest lists a few files per rank; anything larger is not one autopar wrote.
_MAX_MANIFEST_BYTES = 64 * MIB
_READ_CHUNK_BYTES = 8 * MIB
# Files hashed at once (hashlib releases the GIL on large buffers, so threads overlap I/O).
_HASH_THREADS = 8
# Reasons listed in one line before "and N more".
_MAX_LISTED = 3


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(directory: Path, names: list[str]) -> dict[str, str]:
    """sha256 (hex) of each file ``names`` (paths relative to ``directory``), read in threads."""
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, len(names))) as pool:
        digests = pool.map(lambda n: _sha256(directory / n), names)
        return dict(zip(names, digests, strict=True))


def _present_files(directory: Path) -> tuple[dict[str, int], list[str]]:
    """Regular files under ``directory`` (relative POSIX path -> bytes), manifest excluded, and
    the entries that are not regular files (links, sockets, ...)."""
    files: dict[str, int] = {}
    odd: list[str] = []
    for root, dirs, names in os.walk(directory):
        base = Path(root)
        for name in [*names, *(d for d in dirs if (base / d).is_symlink())]:
            path = base / name
            rel = path.relative_to(directory).as_posix()
            if path.is_symlink() or not path.is_file():
                odd.append(rel)
            elif rel != MANIFEST_NAME:
                files[rel] = path.stat().st_size
    return files, sorted(odd)


def write_manifest(
    directory: Path, facts: Mapping[str, Any], digests: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Hash every file of the finished checkpoint ``directory`` and write its manifest, last.

    Args:
        directory: the checkpoint directory, every other file already written.
        facts: JSON-ready facts recorded beside the files (step, world size, config).
        digests: sha256 already computed for some files (relative path -> hex), e.g. by the
            ranks that wrote them; the other files are hashed here.

    Returns:
        The manifest written.
    """
    sizes, odd = _present_files(directory)
    if odd:
        raise ValueError(f"checkpoint {directory} holds entries that are not files: {odd}")
    known = dict(digests or {})
    known.update(file_digests(directory, sorted(set(sizes) - set(known))))
    manifest = {
        **facts,
        "format": MANIFEST_FORMAT,
        "files": {n: {"bytes": sizes[n], "sha256": known[n]} for n in sorted(sizes)},
    }
    tmp = directory / (MANIFEST_NAME + ".tmp")
    with tmp.open("w") as f:
        json.dump(manifest, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_NAME)
    return manifest


def _valid_files(doc: Any) -> dict[str, dict[str, Any]] | None:
    """The ``files`` table of a manifest document, or None when it is not an autopar manifest.

    Names must be plain relative paths inside the checkpoint (no ``..``, not absolute): the
    manifest is data from the directory and must not point elsewhere.
    """
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        return None
    files = doc.get("files")
    if not isinstance(files, dict):
        return None
    for name, entry in files.items():
        parts = PurePosixPath(name).parts
        if (name.startswith("/") or "\\" in name or not parts or ".." in parts
                or name == MANIFEST_NAME or not isinstance(entry, dict)):
            return None
        size, digest = entry.get("bytes"), entry.get("sha256")
        if (isinstance(size, bool) or not isinstance(size, int) or size < 0
                or not isinstance(digest, str) or not _SHA256.match(digest)):
            return None
    return files


def _read_manifest(directory: Path) -> tuple[dict[str, dict[str, Any]] | None, str]:
    """``(files, "")`` from the manifest of ``directory``, or ``(None, reason)``."""
    path = directory / MANIFEST_NAME
    if not os.path.lexists(path):
        return None, NOT_AUTOPAR
    try:
        if path.is_symlink() or path.stat().st_size > _MAX_MANIFEST_BYTES:
            return None, "unreadable manifest (a link, or too large)"
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        return None, f"unreadable manifest ({type(err).__name__})"
    files = _valid_files(doc)
    if files is None:
        return None, f"unreadable manifest (not an {MANIFEST_FORMAT} manifest)"
    return files, ""


def manifest_problem(directory: Path, *, rank: int = 0, world_size: int = 1) -> str | None:
    """What is wrong with checkpoint ``directory`` against its manifest; None if it verifies.

    Every rank checks the file list and sizes (cheap); the hashes are shared: rank ``rank`` of
    ``world_size`` reads every ``world_size``-th file in sorted order, so the ranks together read
    the checkpoint once.

    Returns:
        None, or one short reason ("file __0_0.distcp is missing", ``NOT_AUTOPAR``, ...).
    """
    files, reason = _read_manifest(directory)
    if files is None:
        return reason
    try:
        return _files_problem(directory, files, rank=rank, world_size=world_size)
    except OSError as err:
        return f"cannot read it ({err.strerror or type(err).__name__})"


def _files_problem(
    directory: Path, files: dict[str, dict[str, Any]], *, rank: int, world_size: int
) -> str | None:
    """``manifest_problem`` once the manifest is read: the files against its table."""
    present, odd = _present_files(directory)
    if odd:
        return f"{odd[0]} is not a regular file"
    missing = sorted(set(files) - set(present))
    if missing:
        return f"file {missing[0]} is missing"
    extra = sorted(set(present) - set(files))
    if extra:
        return f"file {extra[0]} is not in the manifest"
    for name in sorted(files):
        if present[name] != files[name]["bytes"]:
            expected = files[name]["bytes"]
            return f"file {name} has {present[name]} bytes, its manifest says {expected}"
    share = sorted(files)[rank::world_size]
    digests = file_digests(directory, share)
    bad = [name for name in share if digests[name] != files[name]["sha256"]]
    return f"file {bad[0]} does not match its sha256 in the manifest" if bad else None


def _listed(items: tuple[str, ...]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return f"{shown} and {more} more" if more > 0 else shown


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePoint:
    """Which checkpoint a run resumes from, and what it passed over.

    Attributes:
        step: the step of the newest usable checkpoint (None: none is usable).
        skipped: newer checkpoints passed over, newest first, as ``"step_N (reason)"``.
        unverified: ``step`` has no manifest and is loaded because the user trusts it.
    """

    step: int | None
    skipped: tuple[str, ...] = ()
    unverified: bool = False

    def note(self) -> str:
        """One line for stderr about what was skipped or loaded unverified ("" when nothing)."""
        parts = [f"skipped {_listed(self.skipped)}"] if self.skipped else []
        if self.unverified:
            parts.append("it has no manifest and is loaded unverified (--trust-checkpoint)")
        if not parts:
            return ""
        where = "nothing to resume" if self.step is None else f"resuming from step_{self.step}"
        return f"{where}; " + "; ".join(parts)

    def refusal(self, checkpoint_dir: str | Path) -> str:
        """The one-line error when no checkpoint of ``checkpoint_dir`` is usable."""
        if not self.skipped:
            return f"checkpoint dir {checkpoint_dir} holds no complete checkpoint to resume"
        if any(NOT_AUTOPAR in s for s in self.skipped):
            fix = ("pass --trust-checkpoint to load a checkpoint autopar did not write, only if "
                   "you trust whoever wrote it (loading it runs code it contains)")
        else:
            fix = "start a new run with a new --checkpoint-dir (or without --resume)"
        return (f"checkpoint dir {checkpoint_dir} holds no complete checkpoint that verifies "
                f"({_listed(self.skipped)}); {fix}")


def checkpoint_steps(checkpoint_dir: str | Path) -> list[int]:
    """The steps of the ``step_N`` directories in ``checkpoint_dir``, newest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for e in root.iterdir()
             if (m := _STEP_DIR.match(e.name)) and e.is_dir()]
    return sorted(steps, reverse=True)


def find_resume_point(
    checkpoint_dir: str | Path,
    *,
    trust: bool,
    check: Callable[[Path], str | None] = manifest_problem,
) -> ResumePoint:
    """The newest checkpoint of ``checkpoint_dir`` that may be loaded, and those skipped.

    Args:
        checkpoint_dir: the run's checkpoint directory.
        trust: ``--trust-checkpoint``: a checkpoint without a manifest that holds DCP metadata
            is loaded (unverified) instead of skipped. A manifest that fails is never trusted.
        check: ``manifest_problem`` or a variant shared among ranks (same answer on every rank).

    Returns:
        The ResumePoint (``step`` None when none is usable).
    """
    root = Path(checkpoint_dir)
    skipped: list[str] = []
    for step in checkpoint_steps(root):
        path = root / f"step_{step}"
        if os.path.lexists(path / MANIFEST_NAME):
            problem = check(path)
        elif not (path / ".metadata").is_file():
            problem = "incomplete: no manifest and no .metadata"
        else:
            problem = None if trust else NOT_AUTOPAR
        if problem is None:
            unverified = not os.path.lexists(path / MANIFEST_NAME)
            return ResumePoint(step=step, skipped=tuple(skipped), unverified=unverified)
        skipped.append(f"step_{step} ({problem})")
    return ResumePoint(step=None, skipped=tuple(skipped))
