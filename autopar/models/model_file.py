"""Load a user's model file: a Python file defining ``build_model()`` and ``example_inputs(b)``.

Optional: ``loss_fn(output, batch)``. autopar calls ``build_model()`` under the meta device for
planning and under the real device for running. Every way a file can be broken (missing, syntax
error, failing import, missing function, a function that raises) becomes one ``ModelFileError``
line naming the file, the line where it applies, and what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import sys
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.errors import ModelFileError
from autopar.timelimit import Expired

__all__ = ["ModelFile", "load_model_file"]

_REQUIRED = ("build_model", "example_inputs")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFile:
    """A loaded model file.

    Attributes:
        path: the file, resolved.
        build_model: ``build_model() -> nn.Module``; raises ModelFileError (naming the original
            exception) if the file's function raises.
        example_inputs: ``example_inputs(batch_size) -> Tensor | tuple``; same error handling.
        loss_fn: the file's ``loss_fn(output, batch)``, or None when it defines none.
    """

    path: Path
    build_model: Callable[[], nn.Module]
    example_inputs: Callable[[int], Any]
    loss_fn: Callable[..., Any] | None

    def instantiate(
        self,
        device: str | torch.device | None = "meta",
        *,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> nn.Module:
        """Call ``build_model()`` with ``device`` as the default device.

        Args:
            device: default device while building ("meta": no memory); None keeps the
                caller's default device (e.g. inside the caller's own ``with torch.device(...)``).
            dtype: convert the parameters to this dtype afterwards (None keeps the file's).
            seed: seed torch's generator for the call (restored afterwards), so a real-device
                build is the same on every process.

        Returns:
            The model.
        """
        place = contextlib.nullcontext() if device is None else torch.device(device)
        with torch.random.fork_rng(devices=[]), place:
            if seed is not None:
                torch.manual_seed(seed)
            model = self.build_model()
        if not isinstance(model, nn.Module):
            raise ModelFileError(
                f"build_model() in {self.path} returned {type(model).__name__}, not a "
                "torch.nn.Module; return the model"
            )
        return model if dtype is None else model.to(dtype)


def _line_in(path: Path, err: BaseException) -> str:
    # The deepest traceback frame inside the model file, as " (line N)", or "" when none is.
    lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == str(path)]
    return f" (line {lines[-1]})" if lines else ""


def _describe(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _guarded(path: Path, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ModelFileError, Expired):
            raise
        except BaseException as err:  # user code: never an exit, nor a traceback
            raise ModelFileError(
                f"{name}() in {path} raised {_describe(err)}{_line_in(path, err)}; "
                f"fix {name} (run the file alone to see the traceback)"
            ) from err

    call.__name__ = name
    call.__doc__ = fn.__doc__
    return call


def _execute(path: Path) -> types.ModuleType:
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ModelFileError(f"cannot read model file {path}: {_describe(err)}") from None
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as err:
        raise ModelFileError(
            f"model file {path} has a syntax error at line {err.lineno}: {err.msg}"
        ) from None
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    name = f"autopar_model_file_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None  # a .py path always has a spec
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        exec(code, module.__dict__)
    except ImportError as err:
        sys.modules.pop(name, None)
        raise ModelFileError(
            f"model file {path} failed to import{_line_in(path, err)}: {_describe(err)}; "
            f"install the missing package or fix the import"
        ) from None
    except Expired:
        sys.modules.pop(name, None)
        raise
    except BaseException as err:  # user code: never an exit, nor a traceback
        sys.modules.pop(name, None)
        raise ModelFileError(
            f"model file {path} raised {_describe(err)} while loading{_line_in(path, err)}"
        ) from None
    return module


def load_model_file(path: str | Path) -> ModelFile:
    """Load a model file.

    Args:
        path: a ``.py`` file defining ``build_model()`` and ``example_inputs(batch_size)`` (and
            optionally ``loss_fn(output, batch)``).

    Returns:
        The ModelFile.

    Raises:
        ModelFileError: the file is missing or unreadable, has a syntax error, fails to import,
            or lacks ``build_model``/``example_inputs``.

    Example:
        >>> mf = load_model_file("my_model.py")
        >>> model = mf.instantiate("meta")
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ModelFileError(f"model file {path} {what}")
    module = _execute(path)
    missing = [n for n in _REQUIRED if not callable(getattr(module, n, None))]
    if missing:
        raise ModelFileError(
            f"model file {path} defines no {' and no '.join(m + '()' for m in missing)}; a model "
            f"file must define build_model() -> nn.Module and example_inputs(batch_size)"
        )
    loss_fn = getattr(module, "loss_fn", None)
    if loss_fn is not None and not callable(loss_fn):
        raise ModelFileError(f"model file {path}: loss_fn must be a function (output, batch)")
    return ModelFile(
        path=path,
        build_model=_guarded(path, "build_model", module.build_model),
        example_inputs=_guarded(path, "example_inputs", module.example_inputs),
        loss_fn=None if loss_fn is None else _guarded(path, "loss_fn", loss_fn),
    )
