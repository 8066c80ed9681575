"""``oneblock explore``: the flags, the --html file, one-line errors, and what ``serve`` prints and binds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from explore_testing import tiny

import oneblock as ob
from oneblock.cli.main import main
from oneblock.explore import server as server_module
from oneblock.explore.analysis import unpack

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from cli_testing import one_line_error


def embedded(path: Path) -> dict:
    html = path.read_text(encoding="utf-8")
    start = html.index('id="explore-data">') + len('id="explore-data">')
    return json.loads(html[start : html.index("</script>", start)])


def test_help_lists_the_model_sources(capsys):
    assert main(["explore", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--checkpoint", "--hf", "--preset", "--host", "--port", "--html", "--text"):
        assert flag in out


def test_html_from_a_preset_holds_the_analysis(tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["explore", "--preset", "lesson", "--html", str(out), "--text", "Hello, block."]) == 0
    assert "wrote" in capsys.readouterr().out
    data = embedded(out)
    assert [t["id"] for t in data["analysis"]["tokens"]] == list(b"Hello, block.")
    assert unpack(data["analysis"]["attention"][0]["weights"]).shape == (2, 4, 13, 13)
    assert data["card"]["parameters"]["total"] == 172_288
    html = out.read_text(encoding="utf-8")
    assert 'src="static/' not in html and 'href="static/' not in html  # everything inlined
    assert "Content-Security-Policy" in html


def test_html_from_a_checkpoint(tmp_path):
    explorable = tiny("decoder")
    path = ob.save(explorable.model, tmp_path / "tiny.safetensors")
    out = tmp_path / "tiny.html"
    assert main(["explore", "--checkpoint", str(path), "--html", str(out), "--text", "abc"]) == 0
    assert embedded(out)["card"]["tokenizer"] == "bytes"


def test_html_of_an_encoder_decoder_takes_a_target(tmp_path):
    from oneblock.explore.page import write_html

    data = embedded(write_html(tiny("encoder-decoder"), tmp_path / "s2s.html", "source text", target="tgt"))
    assert [g["name"] for g in data["analysis"]["attention"]] == ["encoder", "decoder", "cross"]
    assert unpack(data["analysis"]["attention"][2]["weights"]).shape == (2, 3, 3, 11)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--text", "hi"], "--text and --target describe the --html page"),
        (["--html", "x.html"], "--html needs --text"),
        (["--preset", "lesson", "--model", "minilm", "--html", "x.html", "--text", "a"], "--preset and --model set"),
        (["--model", "missing.gguf", "--html", "x.html", "--text", "a"], "'missing.gguf' does not exist"),
        (["--preset", "nope", "--html", "x.html", "--text", "a"], "unknown preset 'nope'"),
        (["--preset", "tiny", "--html", "x.html", "--text", "a"], r"outside the model's vocabulary \[0, 10\)"),
        (["--preset", "lesson", "--html", "x.html", "--text", "a", "--target", "b"], "apply to encoder-decoder"),
        (["--port", "70000"], r"--port must lie in \[0, 65535\]"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--host", ""], "--host is empty, which would listen on every network interface"),
        (["--host", " "], "--host is empty"),
        (["--html", "x.html", "--text", "caf\udcff", "--preset", "lesson"], "not valid UTF-8: byte 0xff at character"),
    ],
)
def test_bad_flags_give_one_line(argv, match, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line_error(capsys, main(["explore", *argv]), empty_stdout=False)
    assert pytest.importorskip("re").search(match, line), line
    assert not (tmp_path / "x.html").exists()


def test_serving_defaults_to_loopback(monkeypatch):
    calls = []
    monkeypatch.setattr(server_module, "serve", lambda explorable, **kwargs: calls.append(kwargs))
    assert main(["explore", "--preset", "lesson", "--port", "0", "--max-tokens", "7"]) == 0
    assert calls[0]["host"] == "127.0.0.1" and calls[0]["port"] == 0
    assert calls[0]["limits"].max_tokens == 7


def test_serve_prints_the_url_and_runs_uvicorn(monkeypatch, capsys):
    import uvicorn

    ran = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: ran.append(sockets[0].getsockname()))
    server_module.serve(tiny("decoder"), port=0)
    captured = capsys.readouterr()
    host, port = ran[0][:2]
    assert host == "127.0.0.1"
    assert f"http://127.0.0.1:{port}/" in captured.out
    assert "warning" not in captured.err


def test_serve_warns_off_loopback(monkeypatch, capsys):
    import uvicorn

    bound, real_bind = [], server_module.bind

    def loopback_instead(host, port):  # the test never opens a port beyond 127.0.0.1
        bound.append(host)
        return real_bind("127.0.0.1", 0)

    monkeypatch.setattr(server_module, "bind", loopback_instead)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: sockets[0].close())
    server_module.serve(tiny("decoder"), host="0.0.0.0", port=0)
    assert bound == ["0.0.0.0"]
    assert "warning: serving on 0.0.0.0, reachable from other machines" in capsys.readouterr().err


def test_serve_answers_its_own_port_only_and_bounds_connections(monkeypatch):
    import uvicorn
    from starlette.testclient import TestClient

    from oneblock.web.transport import GuardedH11

    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: seen.append((self.config, sockets[0])))
    server_module.serve(tiny("decoder"), port=0)
    config, sock = seen[0]
    port = sock.getsockname()[1]
    sock.close()
    assert config.http is GuardedH11 and config.max_connections == 64 and config.timeout_keep_alive == 5
    assert TestClient(config.app, base_url=f"http://localhost:{port}").get("/api/card").status_code == 200
    other = TestClient(config.app, base_url=f"http://localhost:{port + 1}").get("/api/card")
    assert other.status_code == 400 and "is not this server's" in other.json()["error"]
