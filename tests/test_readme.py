"""The README's examples run as written."""

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_examples_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for code in blocks("python"):
        exec(compile(code, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "16640 33088 49984 172288" in out


@pytest.mark.parametrize("line", [
    line for code in blocks("console") for line in code.splitlines() if line.startswith("$ oneblock ")
])
def test_readme_commands_run(line, tmp_path, monkeypatch):
    from oneblock.cli.main import main

    monkeypatch.chdir(tmp_path)  # commands that write files write them here

    assert main(shlex.split(line)[2:]) == 0
