"""The README's examples run as written and print what the README shows.

A ``console`` block lists commands (``$ oneblock ...``), each followed by lines of its output: ``...`` stands for
lines left out, and every other line must appear in what the command prints (compared with runs of spaces
collapsed, since table widths follow the terminal).

The figures table quotes docs/: each row links the docs section it comes from, its link text the label of the docs
table row, and its oneblock, baseline and ratio cells must equal that row's cells, so that a docs table changed
without the README, or the README without the docs, fails here.
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


# The figures table: every speed and memory figure of the README is a row of a table in docs/, quoted.

ROOT = README.parent
FIGURE_COLUMNS = ("oneblock", "baseline", "ratio")
LINK = re.compile(r"^\[(?P<label>.+)\]\((?P<file>docs/[\w./-]+\.md)#(?P<anchor>[\w-]+)\)$")


def table_rows(lines):
    """Rows of a Markdown table as lists of stripped cells (the separator row left out)."""
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if not all(re.fullmatch(r":?-+:?", c) for c in cells):
            rows.append(cells)
    return rows


def figures_table(text):
    """The README's figures table: a list of {header: cell} dicts."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and all(f"| {name} |" in line for name in (*FIGURE_COLUMNS, "CPU", "reproduce")):
            header, *rows = table_rows(lines[i:])
            return [dict(zip(header, row, strict=True)) for row in rows]
    raise AssertionError("README.md has no figures table (columns oneblock, baseline, ratio, CPU, reproduce)")


def slug(heading):
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def section(root, file, anchor):
    """The lines of ``file`` under the heading whose anchor is ``anchor``, up to the next heading."""
    lines = (root / file).read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("#") and slug(line.lstrip("#")) == anchor]
    assert len(starts) == 1, f"{file} has {len(starts)} headings with the anchor #{anchor}"
    end = next((j for j in range(starts[0] + 1, len(lines)) if lines[j].startswith("#")), len(lines))
    return lines[starts[0] : end]


def docs_row(root, file, anchor, label):
    """The docs row a README row quotes: the first table row of the section whose first cell is ``label`` or starts
    with it (followed by a space, comma or parenthesis), as {header: cell}. Docs put the latest figures first."""
    lines = section(root, file, anchor)
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            header, *rows = table_rows(lines[i:])
            for row in rows:
                if row[0] == label or re.match(re.escape(label) + r"[ ,(]", row[0]):
                    return dict(zip(header, row, strict=True))
    raise AssertionError(f"no table row {label!r} in {file}#{anchor}")


def quoted_cells(docs):
    """The docs cells that the README's figure columns quote: oneblock, the column after it, and the ratio."""
    headers = list(docs)
    out = {name: "" for name in FIGURE_COLUMNS}
    if "oneblock" in headers:
        out["oneblock"] = docs["oneblock"]
        out["baseline"] = docs[headers[headers.index("oneblock") + 1]]
    ratio = [h for h in headers if h in ("ratio", "measured")]
    if ratio:
        out["ratio"] = docs[ratio[0]]
    return out


def figure_mismatches(text, root=ROOT):
    """Every way the README's figures table departs from the docs rows it quotes (empty when they agree)."""
    problems = []
    for row in figures_table(text):
        link = LINK.match(row["measurement (its docs table)"])
        if link is None:
            problems.append(f"{row['measurement (its docs table)']!r} does not link a docs section")
            continue
        file, anchor, label = link["file"], link["anchor"], link["label"]
        where = f"{file}#{anchor} {label!r}"
        for name, cell in quoted_cells(docs_row(root, file, anchor, label)).items():
            # a docs cell may add a parenthesis after its figure: "1.74x (medians 179.1 / 102.7)"
            if row[name] not in (cell, re.sub(r"\s*\(.*\)$", "", cell)):
                problems.append(f"{where}: README {name} {row[name]!r}, docs {cell!r}")
        body = collapse("\n".join(section(root, file, anchor)))
        cpu = re.search(r'"([^"]+)"', row["CPU"])
        if cpu is None or cpu[1] not in body:
            problems.append(f"{where}: the CPU {row['CPU']!r} is not the one that section names")
        commands = re.findall(r"`([^`]+)`", row["reproduce"])
        if not commands:
            problems.append(f"{where}: no command reproduces it")
        for command in commands:
            script = re.fullmatch(r"python (benchmarks/\w+\.py)", command)
            target = re.fullmatch(r"make ([\w-]+)", command)
            if (command if script is None else Path(script[1]).name) not in body:
                problems.append(f"{where}: {command!r} is not a command that section was measured with")
            elif script is not None and not (root / script[1]).is_file():
                problems.append(f"{where}: {script[1]} does not exist")
            elif target is not None and not re.search(rf"^{target[1]}:", (root / "Makefile").read_text(), re.M):
                problems.append(f"{where}: the Makefile has no target {target[1]!r}")
    return problems


def test_readme_figures_equal_the_docs_rows_they_quote():
    rows = figures_table(README.read_text())
    assert len(rows) >= 5
    assert figure_mismatches(README.read_text()) == []


def test_changing_any_readme_figure_fails_the_check():
    text = README.read_text()
    changed = 0
    for row in figures_table(text):
        for name in FIGURE_COLUMNS:
            cell = row[name]
            for number in set(re.findall(r"\d+(?:[.,]\d+)*", cell)):
                other = number[:-1] + str((int(number[-1]) + 1) % 10)
                line = "| " + " | ".join(row.values()) + " |"
                assert text.count(line) == 1
                new_cell = re.sub(rf"(?<![\d.,]){re.escape(number)}(?![\d])", other, cell, count=1)
                new_line = line.replace(f"| {cell} |", f"| {new_cell} |", 1)
                assert new_line != line
                assert figure_mismatches(text.replace(line, new_line)), f"{number} -> {other} in {row}"
                changed += 1
    assert changed >= 20


def test_changing_a_docs_figure_fails_the_check(tmp_path):
    row = figures_table(README.read_text())[0]
    link = LINK.match(row["measurement (its docs table)"])
    assert link is not None
    docs = tmp_path / "docs"
    docs.mkdir()
    for page in (ROOT / "docs").glob("*.md"):
        (docs / page.name).write_text(page.read_text())
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    (tmp_path / "Makefile").write_text((ROOT / "Makefile").read_text())
    assert figure_mismatches(README.read_text(), tmp_path) == []
    page = docs / Path(link["file"]).name
    before = page.read_text()
    assert f"| {row['ratio']}" in before
    page.write_text(before.replace(f"| {row['ratio']}", "| 9.99x", 1))
    problems = figure_mismatches(README.read_text(), tmp_path)
    assert len(problems) == 1
    assert f"{link['label']!r}: README ratio {row['ratio']!r}, docs '9.99x" in problems[0]


def test_speed_and_memory_figures_appear_only_in_the_figures_table():
    """A figure typed anywhere else in the README would not be checked: there are none."""
    figure = re.compile(r"\d\s*(?:tok/s|tokens/s|[MG]B\b|GB/s|ms\b)|\b\d+(?:\.\d+)?x\b")
    table = {"| " + " | ".join(row.values()) + " |" for row in figures_table(README.read_text())}
    stray = [line for line in README.read_text().splitlines() if line not in table and figure.search(line)]
    assert stray == []
