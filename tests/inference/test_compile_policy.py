"""``compile=True`` never makes CPU decoding slower: it runs the eager step there and says why, once."""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.errors import ConfigError
from oneblock.inference import compile_policy
from oneblock.inference.compile_policy import ENV_COMPILE, REASON, compile_backend
from oneblock.inference.decode import LeanDecode
from oneblock.inference.generation import generate
from oneblock.inference.request import prepare

CPU, GPU = torch.device("cpu"), torch.device("meta")  # any device but the CPU stands for an accelerator


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(compile_policy, "_said", False)
    monkeypatch.delenv(ENV_COMPILE, raising=False)


def test_true_on_the_cpu_runs_eager_and_says_why_once(capsys):
    assert compile_backend(True, CPU) is None
    assert compile_backend(True, CPU) is None
    err = capsys.readouterr().err
    assert err == REASON + "\n"  # one line, printed once per process
    assert "slower" in err and "ONEBLOCK_COMPILE=force" in err


def test_false_says_nothing(capsys):
    assert compile_backend(False, CPU) is None
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("compile", "device", "env", "expected"),
    [
        (True, CPU, "force", "inductor"),  # the user insists
        (True, CPU, "FORCE ", "inductor"),
        (True, GPU, None, "inductor"),  # launch overheads are what compiling removes there
        ("aot_eager", CPU, None, "aot_eager"),  # a backend named explicitly is always honoured
        (True, CPU, "auto", None),
        (True, CPU, "", None),
    ],
)
def test_choices(monkeypatch, capsys, compile, device, env, expected):
    if env is not None:
        monkeypatch.setenv(ENV_COMPILE, env)
    assert compile_backend(compile, device) == expected
    assert (capsys.readouterr().err == "") == (expected is not None)


def test_unknown_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(ENV_COMPILE, "yes")
    with pytest.raises(ConfigError, match=r"ONEBLOCK_COMPILE must be one of \['auto', 'force'\]; got 'yes'"):
        compile_backend(True, CPU)


def test_generate_with_compile_true_on_the_cpu_equals_eager(capsys):
    torch.manual_seed(0)
    cfg = ob.ModelConfig(vocab_size=53, d_model=32, n_heads=4, d_ff=37, max_seq_len=24, n_layers=2)
    model = ob.build_model(cfg).eval()
    prompt = torch.tensor([[3, 5, 7]])
    run = prepare(model, prompt.tolist(), 4, False, None, None, None, None)
    lean = LeanDecode(run, compile=True)
    assert not lean._compiled and lean.compile_seconds is None  # the eager step (native where it applies)
    stats: dict[str, float] = {}
    eager = generate(model, prompt, 4, greedy=True, return_logits=True)
    flagged = generate(model, prompt, 4, greedy=True, return_logits=True, compile=True, stats=stats)
    assert torch.equal(eager[0], flagged[0]) and torch.equal(eager[1], flagged[1])
    assert "compile_seconds" not in stats
    assert capsys.readouterr().err == REASON + "\n"
