"""The ``autopar`` command line: ``main(argv) -> int``.

Every subcommand lives in its own module ``autopar/cli/cmd_<name>.py`` that defines ``NAME``,
``HELP``, ``ORDER`` (position in ``--help``), ``add_arguments(parser)`` and ``run(args) -> int``.
Adding a subcommand is adding one such module: they are discovered here. Only the selected
subcommand's module builds its full argument list, so ``autopar presets`` does not pay for what
``autopar run`` imports.

Streams: a command's document (``--json``, ``export``) is the only thing on stdout; the report,
progress, logs and warnings go to stderr (the report goes to stdout when no document is asked
for). Errors: one line ``autopar: error: <message>`` on stderr and exit code 2; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from autopar.errors import AutoparError

__all__ = ["EXIT_USAGE", "console", "main"]

EXIT_USAGE = 2  # argparse's own exit code for bad usage; every user error uses it too.
_PREFIX = "cmd_"


class UsageError(AutoparError):
    """Bad command-line usage (argparse's errors), printed as one ``autopar: error:`` line."""


class _Parser(argparse.ArgumentParser):
    """argparse without the usage block: an error is one line naming the fix (``--help``)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _command_modules() -> list[ModuleType]:
    """The ``cmd_*`` modules of this package, in ``ORDER``."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith(_PREFIX))
    modules = [importlib.import_module(f"{__name__}.{n}") for n in names]
    return sorted(modules, key=lambda m: (getattr(m, "ORDER", 100), m.NAME))


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Build the parser; only the subcommand named in ``argv`` gets its full arguments.

    Args:
        argv: the arguments about to be parsed (``None``: build every subcommand fully).

    Returns:
        The top-level ``argparse.ArgumentParser``.
    """
    from autopar import __version__

    parser = _Parser(
        prog="autopar",
        description="Plan, explain, export and run the parallel split of a training job.",
    )
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    modules = _command_modules()
    wanted = next((a for a in (argv or ()) if a in {m.NAME for m in modules}), None)
    common = _Parser(add_help=False)
    # SUPPRESS: the subcommand's --debug must not reset a --debug given before the subcommand.
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    for module in modules:
        p = sub.add_parser(
            module.NAME, help=module.HELP, description=module.HELP, parents=[common]
        )
        p.set_defaults(_module=module)
        if argv is None or wanted is None or wanted == module.NAME:
            module.add_arguments(p)
    return parser


def _one_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return " ".join(text.split())


def _closed_stdout() -> int:
    """The reader of stdout went away (``| head``): outputs are written; end quietly with 0.

    Python's own advice (docs, "Note on SIGPIPE"): point stdout at devnull so that the flush at
    exit does not raise again.
    """
    import os

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0


def _check_force(args: argparse.Namespace) -> None:
    """``--force`` overwrites the files ``--out`` and ``--plot`` name; alone it would do nothing."""
    if getattr(args, "force", False) and not any(
        getattr(args, name, None) for name in ("out", "plot")
    ):
        raise UsageError("--force overwrites the file --out or --plot names; name one, or drop "
                         "--force")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autopar`` command line.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The process exit code: 0 on success, 2 for any user error.
    """
    from autopar.plan import PlanFormatError

    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(args_list).parse_args(args_list)
        _check_force(args)
    except UsageError as error:
        print(f"autopar: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _closed_stdout()
    except (AutoparError, PlanFormatError, ValueError, OSError) as error:
        if getattr(args, "debug", False):
            raise
        print(f"autopar: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as error:  # a bug in autopar, not in the input: say so, briefly
        if getattr(args, "debug", False):
            raise
        print(
            f"autopar: internal error: {type(error).__name__}: {_one_line(error)} "
            "(please report it; rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


def console() -> NoReturn:
    """The ``autopar`` executable: ``main``, then exit at once with its code, streams flushed.

    A model file's code ran to build its model and may have left a non-daemon thread or an
    ``atexit`` hook behind; the command has said all it has to say, so neither may keep the
    process alive nor add to its output (``plan --json`` prints one document)."""
    try:
        code = main()
    except SystemExit as stop:  # argparse's --help and --version
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
