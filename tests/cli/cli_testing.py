"""Helpers shared by the command-line tests."""


def one_line_error(capsys, code: int, *, empty_stdout: bool = True) -> str:
    """Assert the command failed with status 2 and one ``oneblock: error: ...`` line on stderr; return that line."""
    captured = capsys.readouterr()
    assert code == 2
    if empty_stdout:
        assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("oneblock: error: ")
    assert "Traceback" not in captured.err
    return lines[0]
