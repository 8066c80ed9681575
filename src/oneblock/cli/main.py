"""Entry point of the ``oneblock`` command: one argparse parser, one module per subcommand.

Each subcommand lives in ``oneblock/cli/<name>.py`` and exposes ``add_parser(subparsers)`` and
``run(args) -> int``. Subcommand modules import only argparse-level helpers at the top and do their heavy
imports (torch, the models, matplotlib) inside ``run``, so building the parser, and ``oneblock --help``, stays
cheap.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import NoReturn

# Adding a subcommand is adding its module name here, in the order ``--help`` lists them.
SUBCOMMANDS: tuple[str, ...] = (
    "demo",
    "count",
    "trace",
    "check",
    "plot",
    "embed",
    "convert",
    "generate",
    "chat",
    "train",
    "finetune",
    "experiment",
    "explore",
    "serve",
)

PROG = "oneblock"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (``oneblock: error: ...``) and exit status 2.

    Subparsers inherit the class, so a bad flag anywhere reads the same.
    """

    def error(self, message: str) -> NoReturn:
        hint = f" (see '{self.prog} --help')"
        self.exit(2, f"{PROG}: error: {_one_line(message)}{hint}\n")


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def build_parser(only: str | None = None) -> Parser:
    """The parser, with every subcommand in ``SUBCOMMANDS`` registered, or only ``only``'s module imported.

    ``main`` passes the subcommand named on the command line as ``only``: running one command then imports that
    command's module alone, and the full list is built for ``--help``, ``--version`` and mistakes.
    """
    parser = Parser(
        prog=PROG,
        description=(
            "The transformer block from first principles: build it, count it, trace it, check it, plot it. "
            "Run 'oneblock <command> --help' for the flags of one command."
        ),
    )
    from oneblock import __version__
    from oneblock.cli.spelling import FLAG_NAMES, flag_names

    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>", title="commands")
    subparsers.required = True
    for name in SUBCOMMANDS if only is None else (only,):
        module = importlib.import_module(f"oneblock.cli.{name}")
        sub = module.add_parser(subparsers)
        sub.set_defaults(  # messages name a flag by its one name
            _run=module.run, _start_up=getattr(module, "PAUSE_COLLECTOR", False), **{FLAG_NAMES: flag_names(sub)}
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (``sys.argv[1:]`` when ``None``); returns the exit status.

    Errors a user can fix (any ``OneBlockError``, bad flags, a file that cannot be read or written) print one line
    on stderr and return 2. Any other exception is a bug in oneblock: one line naming it, status 1, and the
    traceback only when the environment sets ``ONEBLOCK_DEBUG=1``.
    """
    from oneblock.errors import OneBlockError
    from oneblock.inference import process

    argv = sys.argv[1:] if argv is None else argv
    if "torch" not in sys.modules:  # a fresh process: its start-up is all still to come
        process.pause_for_start_up()
    parser = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version and argparse errors
        process.start_up_done(freeze=False)
        return _exit_code(stop.code)
    if not args._start_up:  # the command says when its start-up ends (process.start_up_done), or it is over
        process.start_up_done(freeze=False)
    try:
        return int(args._run(args))
    except OneBlockError as error:
        print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``oneblock count --json | head``): stop quietly
        _silence_stdout()
        return 1
    except OSError as error:  # a file that cannot be read or written: --out in a read-only place, a full disk
        print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        return 2
    except Exception as error:  # a bug: say so in one line; the traceback is for whoever fixes it
        if os.environ.get("ONEBLOCK_DEBUG") == "1":
            traceback.print_exc()
            hint = ""
        else:
            hint = " (set ONEBLOCK_DEBUG=1 to see the traceback)"
        print(f"{PROG}: internal error: {type(error).__name__}: {_one_line(error)}{hint}", file=sys.stderr)
        return 1
    finally:
        process.start_up_done()  # if the command did not get that far


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no file descriptor (captured output)
        pass


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


if __name__ == "__main__":
    sys.exit(main())
