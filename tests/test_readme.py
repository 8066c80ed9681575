"""The README's examples run as written and print what the README shows.

A ``console`` block lists commands (``$ oneblock ...``), each followed by lines of its output: ``...`` stands for
lines left out, and every other line must appear in what the command prints (compared with runs of spaces
collapsed, since table widths follow the terminal).
"""

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def commands():
    """(command line, expected output lines) for every command of every console block."""
    out = []
    for code in blocks("console"):
        for line in code.splitlines():
            if line.startswith("$ "):
                out.append((line, []))
            elif out and line.strip() not in ("", "..."):
                out[-1][1].append(line)
    return out


def collapse(text):
    return " ".join(text.split())


def test_readme_python_examples_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for code in blocks("python"):
        if "OpenAI(base_url=" in code:  # a client of `oneblock serve`: tests/serve makes these calls to a live server
            continue
        exec(compile(code, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "16640 33088 49984 172288" in out
    assert "torch.Size([2, 16, 1000]) torch.Size([2, 4, 16, 16])" in out


def test_every_console_command_shows_its_output():
    lines = [line for line, expected in commands() if line.startswith("$ oneblock ") and not expected]
    assert not lines, f"README commands without a line of their output: {lines}"


@pytest.mark.parametrize(
    ("line", "expected"), [c for c in commands() if c[0].startswith("$ oneblock ")], ids=lambda v: str(v)[:60]
)
def test_readme_commands_print_what_the_readme_shows(line, expected, tmp_path, monkeypatch, capsys):
    from oneblock.cli.main import main

    monkeypatch.chdir(tmp_path)  # commands that write files write them here
    assert main(shlex.split(line)[2:]) == 0
    printed = collapse(capsys.readouterr().out)
    for want in expected:
        assert collapse(want) in printed, f"{line!r} did not print {want!r}"
