"""Output files of the commands: written whole or not at all, never over what the user had.

A document goes to a temporary file beside its path and replaces the path only once every
document of the command is written; an existing file is replaced only with ``--force``; a path
the command reads (its plan) is never written; a path that names a directory is refused.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from autopar.errors import AutoparError

__all__ = ["check_plot_path", "check_writable", "write_output", "write_outputs"]


def write_output(path: str, data: str | bytes, *, force: bool) -> None:
    """Write ``data`` to ``path``; never overwrite an existing file unless ``force``.

    Raises:
        AutoparError: the file exists (without ``force``) or cannot be written.
    """
    write_outputs([(path, data)], force=force)


def write_outputs(files: list[tuple[str, str | bytes]], *, force: bool) -> None:
    """Write every ``(path, data)`` or none: each document goes to a temporary file beside its
    path first and replaces the path only once all are written, so a failed write (a full disk,
    a directory in the way) leaves what the user had, and no half-written file.

    Raises:
        AutoparError: a file exists (without ``force``) or cannot be written.
    """
    for path, _data in files:
        check_writable(path, force=force)
    staged: list[tuple[str, Path]] = []
    try:
        for path, data in files:
            # A symbolic link is written through: the file it names is replaced, the link kept.
            target = Path(os.path.realpath(path))
            fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                        dir=target.parent)
            staged.append((str(target), Path(name)))
            with os.fdopen(fd, "wb") as out:
                out.write(data if isinstance(data, bytes) else data.encode())
            # The replaced file's permissions, or what open() would have made.
            mode = (stat.S_IMODE(target.stat().st_mode) if target.exists()
                    else 0o666 & ~_umask())
            os.chmod(name, mode)
        for path, temporary in staged:
            os.replace(temporary, path)
    except OSError as e:
        for _path, temporary in staged:
            temporary.unlink(missing_ok=True)
        raise AutoparError(f"cannot write {e.filename or files[0][0]}: {e.strerror or e}") from e


def _umask() -> int:
    """The process's file-creation mask."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_plot_path(path: str | None, *, force: bool, reads: Sequence[str] = ()) -> None:
    """``check_writable`` for a ``--plot`` path, which must name a PNG file (the figure is
    written as PNG whatever the name says)."""
    if path is not None and Path(path).suffix.lower() != ".png":
        raise AutoparError(f"--plot {path}: the plot is a PNG image; give a path ending in .png")
    check_writable(path, force=force, reads=reads)


def check_writable(path: str | None, *, force: bool, reads: Sequence[str] = ()) -> None:
    """Fail early (before a long search) when ``path`` cannot be written, or is one of the
    files the command ``reads`` (``--force`` replaces an old output, never the input)."""
    if path is None:
        return
    if not path:
        raise AutoparError("an output path is empty; give a file name")
    target = Path(path)
    if target.is_dir():
        raise AutoparError(f"{path} is a directory; give a file name")
    if path.endswith(("/", os.sep)):
        raise AutoparError(f"{path} ends in a separator, a directory's name; give a file name")
    for source in reads:
        if os.path.realpath(source) == os.path.realpath(path):
            raise AutoparError(f"{path} is the file this command reads; write to another file")
    if os.path.lexists(target) and not force:  # a dangling link too: writing would create
        raise AutoparError(f"{path} already exists; pass --force to overwrite it")
    if target.exists() and not target.is_file():
        raise AutoparError(f"{path} is not a regular file (a device, pipe or socket); give a "
                           "file name")
    target = Path(os.path.realpath(path))  # a link's target is what gets written
    parent = target.parent
    if not parent.is_dir():
        raise AutoparError(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise AutoparError(f"cannot write {path}: directory {parent} is not writable")
