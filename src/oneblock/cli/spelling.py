"""One name per idea on the command line: a flag's one name, its older spellings kept as hidden aliases, and library
errors (which speak of parameters: ``seq_len``, ``resume=True``) reworded into the flags of a command.

A flag and its aliases share one ``dest``; ``--help`` shows the one name, whose help says which aliases it has.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

# The namespace attribute that records, per dest, the spelling typed on the command line.
SPELLED = "_spelled"
# The namespace attribute ``main`` sets to ``flag_names(subparser)``.
FLAG_NAMES = "_flags"


class Spelled(argparse.Action):
    """Store the value (or ``const``, for a flag that takes none) and remember the spelling that was typed.

    Given under two different spellings of one dest (``--model a --checkpoint b``, ``--to gguf --to-hf``), the
    command is refused instead of the later one silently winning.
    """

    def __init__(self, option_strings: list[str], dest: str, nargs: Any = None, const: Any = None, **kwargs: Any):
        if const is not None:
            nargs = 0
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: Any = None
    ) -> None:
        typed = vars(namespace).setdefault(SPELLED, {})
        before = typed.get(self.dest)
        if before is not None and before != option_string:
            parser.error(f"{before} and {option_string} set the same thing; give one of them")
        typed[self.dest] = option_string
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_alias(container: Any, *names: str, of: argparse.Action, const: Any = None) -> None:
    """Add ``names`` as hidden spellings of the flag ``of`` (made with ``action=Spelled``), and say so in its help.

    Args:
        container: the parser or argument group ``of`` was added to.
        names: the old spellings, e.g. ``"--checkpoint"``.
        of: the flag's one name, the action ``add_argument`` returned.
        const: for an alias that takes no value (``--to-hf``), the value it stands for (``"hf"``).
    """
    one = of.option_strings[0]
    container.add_argument(
        *names,
        dest=of.dest,
        action=Spelled,
        const=const,
        type=None if const is not None else of.type,
        choices=None if const is not None else of.choices,
        metavar=of.metavar,
        default=argparse.SUPPRESS,  # the one name's default stands
        help=argparse.SUPPRESS,
    )
    if const is not None:
        note = f"{' and '.join(names)} {'is an alias' if len(names) == 1 else 'are aliases'} of {one} {const}"
    else:
        listed = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
        note = f"{listed} {'is an alias' if len(names) == 1 else 'are aliases'}"
    of.help = f"{of.help}; {note}" if of.help else note


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``dest -> one name`` for the flags ``--help`` shows."""
    names: dict[str, str] = {}
    for action in parser._actions:
        if action.option_strings and action.help is not argparse.SUPPRESS:
            names.setdefault(action.dest, action.option_strings[0])
    return names


def flag(args: argparse.Namespace, dest: str) -> str:
    """The flag of ``dest`` as the user typed it, else its one name."""
    typed = getattr(args, SPELLED, {}).get(dest)
    if typed is not None:
        return typed
    return getattr(args, FLAG_NAMES, {}).get(dest) or "--" + dest.replace("_", "-")


def reword(text: str, names: Mapping[str, str]) -> str:
    """``text`` with each parameter of ``names`` (``"seq_len"``, ``"resume=True"``) replaced by its flag.

    A parameter is matched whole: ``seq_len`` is not found inside ``max_seq_len`` or ``cfg.seq_len``.
    """
    for parameter in sorted(names, key=len, reverse=True):  # "resume with weights_only=True" before "resume=True"
        flag_name = names[parameter]
        text = re.sub(rf"(?<![\w.]){re.escape(parameter)}(?!\w)", lambda _match: flag_name, text)  # noqa: B023
    return text


@contextlib.contextmanager
def in_flags(names: Mapping[str, str]) -> Iterator[None]:
    """Reword any ``OneBlockError`` raised inside from the library's parameter names into this command's flags."""
    from oneblock.errors import OneBlockError

    try:
        yield
    except OneBlockError as error:
        message = str(error)
        reworded = reword(message, names)
        if reworded == message:
            raise
        raise type(error)(reworded) from error
