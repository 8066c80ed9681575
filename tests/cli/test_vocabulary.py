"""One word per idea: every subcommand's parser speaks the same vocabulary, and the library speaks of parameters.

The walk covers every subcommand in ``SUBCOMMANDS``, so a new command (or a new flag) meets the same rules.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

import oneblock
from oneblock.cli.main import SUBCOMMANDS, build_parser

SRC = Path(oneblock.__file__).parent

# Every subcommand is in exactly one set of each pair, so adding one means deciding where it goes.
LOADS_A_MODEL = {"count", "trace", "check", "plot", "embed", "convert", "generate", "chat", "train", "finetune",
                 "explore", "serve"}  # fmt: skip
LOADS_NO_MODEL = {"demo", "experiment"}
COMPUTES = {"demo", "trace", "check", "plot", "embed", "generate", "chat", "train", "finetune", "experiment",
            "explore", "serve"}  # fmt: skip
COMPUTES_NOTHING = {"count", "convert"}  # analytic counts; tensors copied, not run
LORA_FLAGS = ("--lora-rank", "--lora-alpha", "--lora-dropout", "--lora-targets", "--rslora")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


PARSERS = _subparsers()


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]


def _names(parser: argparse.ArgumentParser) -> set[str]:
    return {name for a in _visible(parser) for name in a.option_strings}


def test_the_sets_cover_every_subcommand():
    assert set(SUBCOMMANDS) == LOADS_A_MODEL | LOADS_NO_MODEL and not LOADS_A_MODEL & LOADS_NO_MODEL
    assert set(SUBCOMMANDS) == COMPUTES | COMPUTES_NOTHING and not COMPUTES & COMPUTES_NOTHING


@pytest.mark.parametrize("name", sorted(LOADS_A_MODEL))
def test_every_command_that_loads_a_model_says_model(name):
    assert "--model" in _names(PARSERS[name])


@pytest.mark.parametrize("name", sorted(COMPUTES))
def test_every_command_that_computes_has_threads(name):
    assert "--threads" in _names(PARSERS[name])


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_flag_shows_one_name(name):
    """``--help`` lists one name per flag; the older spellings are hidden, and the one name's help names them."""
    parser = PARSERS[name]
    for action in _visible(parser):
        longs = [s for s in action.option_strings if s.startswith("--")]
        assert len(longs) == 1 or action.dest == "help", f"{name}: {action.option_strings} shows several names"
    visible = {a.dest: a for a in _visible(parser)}
    hidden = [a for a in parser._actions if a.option_strings and a.help is argparse.SUPPRESS]
    for alias in hidden:
        assert alias.dest in visible, f"{name}: {alias.option_strings} is the alias of no flag shown by --help"
        for spelling in alias.option_strings:
            assert re.search(rf"{re.escape(spelling)}\b.*\balias", visible[alias.dest].help), (
                f"{name}: the help of {visible[alias.dest].option_strings[0]} does not name its alias {spelling}"
            )


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_no_max_tokens_flag_counts_new_tokens_under_another_name(name):
    """A count of new tokens is ``--max-new-tokens`` (serve's default of a request's: ``--default-max-new-tokens``);
    ``--max-tokens`` is shown nowhere."""
    parser = PARSERS[name]
    assert "--max-tokens" not in _names(parser)
    for action in _visible(parser):
        if re.search(r"new tokens|tokens to generate|longest reply", action.help or ""):
            assert "max-new-tokens" in action.option_strings[0], f"{name} {action.option_strings[0]}: {action.help}"


def test_lora_flags_are_spelled_alike_in_finetune_and_count():
    for name in ("finetune", "count"):
        assert set(LORA_FLAGS) <= _names(PARSERS[name]), name
        assert not {"--rank", "--alpha", "--targets"} & _names(PARSERS[name]), name  # kept, but hidden
    for name in ("finetune", "count"):
        defaults = {a.option_strings[0]: a.default for a in _visible(PARSERS[name])}
        assert defaults["--lora-alpha"] == 16.0 and defaults["--lora-targets"] == "q,k,v,o,gate,up,down"


def _help(name: str, flag: str) -> str | None:
    helps = [a.help for a in _visible(PARSERS[name]) if flag in a.option_strings]
    return helps[0] if helps else None


def test_precision_flags_mean_one_thing_each():
    """``--dtype``, ``--exact`` and ``--bf16`` carry one help text each, the meaning written in ``cli/precision``."""
    from oneblock.cli import precision

    for name in ("chat", "generate", "finetune"):
        assert _help(name, "--dtype") == precision.DTYPE_HELP, name
        assert _help(name, "--exact") == precision.EXACT_HELP, name
    for name in ("chat", "generate"):
        assert _help(name, "--bf16") == precision.BF16_RUN_HELP, name
    for name in ("train", "finetune"):
        assert _help(name, "--bf16") == precision.BF16_TRAIN_HELP, name
    assert "compute in bfloat16" in precision.BF16_RUN_HELP and "compute in bfloat16" in precision.BF16_TRAIN_HELP


def test_convert_says_to():
    names = _names(PARSERS["convert"])
    assert "--to" in names and "--to-hf" not in names


def _strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module, docstrings left out (they may show a command line)."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


# Strings outside cli/ that may show a flag: another program's (pip's), a lock's record of the command holding it, and
# the server's own answers about how it was started.
OTHER_PROGRAMS = {
    ("inference/smollm2.py", "--no-deps"),
    ("train/loop.py", "--resume"),  # RunLock(command="oneblock train --resume"): what holds the lock
    ("serve/handlers.py", "--embedding-model"),
    ("serve/handlers.py", "--max-queue"),
    ("serve/server.py", "--api-key"),
}


def test_the_library_names_parameters_not_flags():
    """Outside ``cli/``, messages speak of parameters (``seq_len``, ``resume=True``); the CLI rewords them."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        if where.startswith("cli/"):
            continue
        for line, text in _strings(path):
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text):
                if (where, flag) not in OTHER_PROGRAMS:
                    found.append(f"{where}:{line}: {flag} in {text!r}")
    assert found == []
