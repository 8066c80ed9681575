"""The ``oneblock`` parser: subcommand registry, help on every flag, one-line errors, the installed entry point."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testing import one_line_error

from oneblock.cli.main import SUBCOMMANDS, build_parser, main


def test_top_level_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", ["demo", "count", "trace", "check", "plot"])
def test_subcommand_help(name, capsys):
    assert main([name, "--help"]) == 0
    assert f"usage: oneblock {name}" in capsys.readouterr().out


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                assert choice.help, f"subcommand {choice.dest} has no help"
            for sub in action.choices.values():
                yield from _actions(sub)
        else:
            yield parser.prog, action


def test_every_flag_has_help():
    missing = [f"{prog} {a.option_strings or a.dest}" for prog, a in _actions(build_parser()) if not a.help]
    assert missing == []


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("oneblock ")


@pytest.mark.parametrize(
    "argv",
    [
        ["count", "--no-such-flag"],
        ["no-such-command"],
        [],
        ["count", "--norm", "batchnorm"],
        ["count", "--d-model", "sixty-four"],
        ["trace", "--batch"],
    ],
)
def test_argparse_errors_are_one_line(argv, capsys):
    one_line_error(capsys, main(argv))


def test_impossible_config_names_the_values(capsys):
    line = one_line_error(capsys, main(["count", "--d-model", "64", "--n-heads", "3"]))
    assert "n_heads (3) must divide d_model (64)" in line


def test_unknown_preset_lists_the_names(capsys):
    line = one_line_error(capsys, main(["count", "--preset", "gpt5"]))
    assert "unknown preset 'gpt5'" in line and "smollm2-135m" in line


def test_installed_entry_point():
    exe = Path(sys.executable).parent / "oneblock"
    done = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: oneblock" in done.stdout and "count" in done.stdout
    bad = subprocess.run([str(exe), "count", "--bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("oneblock: error:")


def test_python_dash_m():
    done = subprocess.run(
        [sys.executable, "-m", "oneblock", "count", "--json"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total"] == 172_288
