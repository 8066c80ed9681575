"""``oneblock serve``: flags, one-line errors, and a real process that stops on SIGTERM after finishing its work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest
from cli_testing import one_line_error

import oneblock as ob
from oneblock.cli.main import main

SRC = Path(__file__).parents[2] / "src"


def test_help_lists_the_flags(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--host", "--port", "--api-key", "--embedding-model", "--max-batch", "--max-queue",
                 "--max-tokens", "--timeout", "--grace", "--max-context", "--max-connections", "--header-timeout",
                 "--body-timeout", "--cors-origin", "--cache-budget"):  # fmt: skip
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--max-batch", "0"], "--max-batch must be at least 1; got 0"),
        (["--port", "70000"], r"--port must lie in \[0, 65535\]; got 70000"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds; got 0"),
        (["--max-context", "1"], "--max-context must be at least 2; got 1"),
        (["--max-connections", "0"], "--max-connections must be at least 1; got 0"),
        (["--cache-budget", "-1"], r"--cache-budget must be a number of MiB >= 0; got -1.0"),
        (
            ["--model", "lesson", "--embedding-model", "none", "--cache-budget", "1e11"],
            r"and a prefix cache of .* GiB needs .*; lower --max-context, --max-batch or --cache-budget",
        ),
        (["--header-timeout", "0"], "--header-timeout must be a positive number of seconds; got 0"),
        (["--body-timeout", "-1"], "--body-timeout must be a positive number of seconds; got -1"),
        (["--grace", "inf"], r"--grace must be at most 604800 seconds \(a week\); got inf"),
        (["--grace", "nan"], "--grace must be a positive number of seconds; got nan"),
        (["--timeout", "1e300"], r"--timeout must be at most 604800 seconds \(a week\); got 1e\+300"),
        (["--cors-origin", "localhost:3000"], "--cors-origin: a CORS origin must look like 'http://localhost:3000'"),
        (
            ["--model", "lesson", "--embedding-model", "none", "--max-batch", "100000000"],
            r"more than this machine's memory .*; lower --max-context, --max-batch or --cache-budget",
        ),
        (["--model", "no-such-model", "--embedding-model", "none"], "'no-such-model' is neither a file"),
        (["--model", "t5-small", "--embedding-model", "none"], "batched decoding needs a pre-LN decoder-only model"),
    ],
)
def test_bad_flags_are_one_line_and_status_2(capsys, argv, match):
    import re

    line = one_line_error(capsys, main(["serve", *argv]), empty_stdout=False)
    assert re.search(match, line), line


def test_sigterm_lets_the_request_in_flight_finish_then_exits_0():
    env = {**os.environ, "PYTHONPATH": str(SRC), "ONEBLOCK_API_KEY": "k"}
    process = subprocess.Popen(
        [sys.executable, "-m", "oneblock", "serve", "--model", "lesson", "--port", "0", "--embedding-model", "none",
         "--grace", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = process.stdout.readline() if process.stdout else ""
        assert line.startswith("oneblock serve: lesson at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):  # the key came from ONEBLOCK_API_KEY
            openai.OpenAI(base_url=url, api_key="not-k", max_retries=0).models.list()
        pieces: list[str] = []
        finish: list[str | None] = []
        started = threading.Event()

        def read() -> None:
            stream = client.completions.create(model="x", prompt="abc", max_tokens=100, stream=True, seed=0)
            for chunk in stream:
                started.set()
                pieces.append(chunk.choices[0].text)
                finish.append(chunk.choices[0].finish_reason)

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(60)
        process.send_signal(signal.SIGTERM)
        reader.join(60)
        assert finish[-1] == "length"  # the request in flight ran to its end
        assert process.wait(60) == 0
        with pytest.raises(openai.APIConnectionError):  # and nothing listens any more
            client.completions.create(model="x", prompt="abc", max_tokens=1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serving_off_loopback_warns_and_accepts_any_host(monkeypatch, capsys):
    from oneblock.explore import server as explore_server
    from oneblock.serve import server
    from oneblock.serve.engine import Engine
    from oneblock.text.tokenizer import ByteTokenizer

    made = {}
    monkeypatch.setattr(server, "bind", lambda host, port: explore_server.bind("127.0.0.1", 0))  # not 0.0.0.0
    monkeypatch.setattr(server.GracefulServer, "run", lambda self, sockets: made.update(app=self.config.app))
    engine = Engine(ob.build_model(ob.get_preset("lesson")), ByteTokenizer())
    server.serve(engine, model_name="lesson", host="0.0.0.0", grace=1)
    err = capsys.readouterr().err
    assert "warning: serving on 0.0.0.0, reachable from other machines; no API key is set (--api-key)" in err
    assert made["app"].state.hosts is None  # the Host check is for loopback servers only
