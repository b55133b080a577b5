"""Load a DCP checkpoint as data: no object the checkpoint names is built unless it is listed.

``torch.distributed.checkpoint`` unpickles a checkpoint's ``.metadata`` (``FileSystemReader.
read_metadata``: ``pickle.load``) and ``torch.load``s its non-tensor items with
``weights_only=False`` (``DefaultLoadPlanner.load_bytes``), so a checkpoint loaded through its
defaults can run code it carries, whoever wrote it. autopar loads every checkpoint through
``DataOnlyReader`` and ``DataOnlyPlanner`` instead:

- the metadata's unpickler builds only the classes DCP's own metadata is made of (``ALLOWED``:
  ``torch.distributed.checkpoint.metadata``'s records, the file system reader's ``_StorageInfo``,
  ``torch.Size``, torch dtypes and layouts, paths); any other name refuses the checkpoint;
- non-tensor items (the optimizer's lr, betas, step counts) load with ``weights_only=True``.

The manifest (``manifest.py``) still proves that a checkpoint is complete and unchanged; this
module makes loading one safe even when the manifest is forged or ``--trust-checkpoint`` skips
it.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from autopar.errors import AutoparError

__all__ = ["ALLOWED", "DataOnlyPlanner", "DataOnlyReader", "read_metadata_bytes"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) the metadata's pickle may name: the records DCP writes (torch 2.6-2.13).
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"), (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "TensorStorageMetadata"), (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"), (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    # DCP records its checkpoint_id as a path (pathlib._local from Python 3.13).
    *((module, cls) for module in ("pathlib", "pathlib._local")
      for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    ("collections", "OrderedDict"),
})
# Enum classes whose members the metadata holds: Python 3.11.0-3.11.3 pickle a member as
# getattr(cls, name), later ones as cls(value).
_ENUMS = frozenset({(_DCP_METADATA, "_MEM_FORMAT_ENCODING")})


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr(cls, name)`` for an enum member of an allowed class, nothing else."""
    if (getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)) not in _ENUMS \
            or not isinstance(name, str) or name not in cls.__members__:
        raise AutoparError("the checkpoint's .metadata calls getattr on something other than a "
                           "DCP enum member; resume from a checkpoint autopar wrote")
    return cls[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            if module == "pathlib._local":  # the same classes, importable before 3.13 too
                return getattr(pathlib, name)
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise AutoparError(
            f"the checkpoint's .metadata names {module}.{name}, which DCP's metadata does not "
            "hold; autopar loads checkpoints as data only: resume from a checkpoint autopar "
            "(or torch.distributed.checkpoint) wrote"
        )


def read_metadata_bytes(data: bytes) -> Metadata:
    """A DCP ``.metadata`` file's contents, unpickled with only ``ALLOWED`` names.

    Raises:
        AutoparError: the pickle names anything else, or is not DCP metadata.
    """
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except AutoparError:
        raise
    except Exception as err:  # a damaged pickle: any of pickle's and the records' errors
        raise AutoparError(f"the checkpoint's .metadata cannot be read ({type(err).__name__}: "
                           f"{err}); resume from an intact checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise AutoparError(f"the checkpoint's .metadata holds a {type(metadata).__name__}, not "
                           "DCP metadata; resume from a checkpoint autopar wrote")
    return metadata


class DataOnlyReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by ``read_metadata_bytes``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata_bytes(stream.read())
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class DataOnlyPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
