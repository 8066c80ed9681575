"""Every older spelling still works, means what the one name means, and ``--help`` shows only the one name."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
from cli_testing import one_line_error

import oneblock as ob
from oneblock.cli.main import build_parser, main
from oneblock.cli.spelling import SPELLED

# (command, the one name's arguments, the alias's arguments, the alias)
ALIASES = [
    ("count", ["--model", "gpt2"], ["--preset", "gpt2"], "--preset"),
    ("count", ["--model", "m.safetensors"], ["--checkpoint", "m.safetensors"], "--checkpoint"),
    ("count", ["--lora-rank", "4"], ["--rank", "4"], "--rank"),
    ("check", ["--model", "tiny"], ["--preset", "tiny"], "--preset"),
    ("check", ["--model", "m.safetensors"], ["--checkpoint", "m.safetensors"], "--checkpoint"),
    ("trace", ["--model", "tiny"], ["--preset", "tiny"], "--preset"),
    ("trace", ["--model", "m.safetensors"], ["--checkpoint", "m.safetensors"], "--checkpoint"),
    ("plot", ["--model", "tiny"], ["--preset", "tiny"], "--preset"),
    ("plot", ["--model", "m.safetensors"], ["--checkpoint", "m.safetensors"], "--checkpoint"),
    ("train", ["--model", "tiny"], ["--preset", "tiny"], "--preset"),
    ("generate", ["--model", "m.st", "--prompt", "a"], ["--checkpoint", "m.st", "--prompt", "a"], "--checkpoint"),
    ("explore", ["--model", "m.safetensors"], ["--checkpoint", "m.safetensors"], "--checkpoint"),
    ("explore", ["--model", "hf-dir"], ["--hf", "hf-dir"], "--hf"),
    ("explore", ["--model", "lesson"], ["--preset", "lesson"], "--preset"),
    ("explore", ["--max-input-tokens", "7"], ["--max-tokens", "7"], "--max-tokens"),
    ("serve", ["--default-max-new-tokens", "7"], ["--max-tokens", "7"], "--max-tokens"),
    ("finetune", ["--lora-rank", "4"], ["--rank", "4"], "--rank"),
    ("finetune", ["--lora-alpha", "8"], ["--alpha", "8"], "--alpha"),
    ("finetune", ["--lora-targets", "q,v"], ["--targets", "q,v"], "--targets"),
    ("convert", ["--model", "src", "dst", "--to", "hf"], ["--model", "src", "dst", "--to-hf"], "--to-hf"),
]


def _parsed(argv: list[str]) -> dict:
    args = vars(build_parser().parse_args(argv))
    args.pop(SPELLED, None)  # how it was spelled, kept only to name the flag back in a message
    return args


@pytest.mark.parametrize(("command", "one", "alias", "spelling"), ALIASES, ids=lambda v: str(v))
def test_an_alias_parses_to_what_the_one_name_parses_to(command, one, alias, spelling):
    assert _parsed([command, *alias]) == _parsed([command, *one])


@pytest.mark.parametrize(("command", "one", "alias", "spelling"), ALIASES, ids=lambda v: str(v))
def test_help_shows_the_one_name_and_calls_the_alias_an_alias(command, one, alias, spelling, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag: no flag name broken at a hyphen
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    assert one[0] in usage and spelling not in usage
    assert not re.search(rf"^\s+{re.escape(spelling)}\b", out, flags=re.M)  # no line of its own
    text = " ".join(out.split())
    assert re.search(rf"{re.escape(spelling)} (and [-\w]+ )?(is|are) (an )?alias", text) or re.search(
        rf"{re.escape(spelling)}, .* are aliases", text
    ), text


def test_convert_source_as_the_first_positional_is_an_alias_of_model():
    from oneblock.cli.convert import _source_and_destination

    old = build_parser().parse_args(["convert", "a", "b"])
    new = build_parser().parse_args(["convert", "--model", "a", "b"])
    assert _source_and_destination(old) == _source_and_destination(new)


def test_two_spellings_of_one_flag_are_refused(capsys):
    line = one_line_error(capsys, main(["count", "--preset", "gpt2", "--model", "bert-base"]))
    assert "--preset and --model set the same thing; give one of them" in line
    line = one_line_error(capsys, main(["finetune", "--rank", "4", "--lora-rank", "8"]))
    assert "--rank and --lora-rank set the same thing" in line


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = ob.build_model(ob.get_preset("lesson").replace(n_layers=1))  # 1000 ids: every byte is a token
    return ob.save(model, tmp_path_factory.mktemp("alias") / "lesson.safetensors")


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("alias", ["--preset", "--checkpoint"])
@pytest.mark.parametrize("command", ["count", "check", "trace"])
def test_an_alias_gives_the_same_result(command, alias, checkpoint, capsys):
    source = "gpt2" if alias == "--preset" else str(checkpoint)
    if command != "count" and alias == "--preset":
        source = "tiny"
    extra = ["--seq-len", "3"] if command == "trace" else ["--verify"] if command == "count" else []
    assert _json(capsys, [command, alias, source, "--json", *extra]) == _json(
        capsys, [command, "--model", source, "--json", *extra]
    )


def test_count_lora_short_forms_give_the_same_count(capsys):
    one = _json(capsys, ["count", "--model", "gpt2", "--lora-rank", "4", "--lora-targets", "o,up", "--json"])
    old = _json(capsys, ["count", "--model", "gpt2", "--rank", "4", "--targets", "o,up", "--json"])
    assert one == old and one["lora"]["trainable"] > 0


def test_a_gguf_file_is_a_model_for_count_too(capsys):
    """``--model`` takes what ``load_model`` takes, so count reads a GGUF file's config (and its float32 weights)."""
    from oneblock.errors import CheckpointError
    from oneblock.inference.smollm2 import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except CheckpointError as error:
        pytest.skip(str(error))
    data = _json(capsys, ["count", "--model", str(path), "--json"])
    preset = _json(capsys, ["count", "--model", "smollm2-135m", "--json"])
    shape = ("d_model", "n_heads", "n_kv_heads", "n_layers", "d_ff", "vocab_size")
    assert data["total"] == preset["total"] == 134_515_008
    assert [data["config"][k] for k in shape] == [preset["config"][k] for k in shape]
    assert data["model"] == f"GGUF file {path}"


def test_a_file_refuses_config_flags_naming_the_spelling_typed(checkpoint, capsys):
    line = one_line_error(capsys, main(["count", "--model", str(checkpoint), "--d-model", "16"]))
    assert "--model carries its own config; drop --d-model or drop --model" in line
    line = one_line_error(capsys, main(["count", "--checkpoint", str(checkpoint), "--d-model", "16"]))
    assert "--checkpoint carries its own config; drop --d-model or drop --checkpoint" in line


def test_a_source_that_is_nothing_is_one_line(capsys):
    line = one_line_error(capsys, main(["count", "--model", "gpt5"]))
    assert "--model 'gpt5' does not exist (no such file or directory)" in line and "unknown preset 'gpt5'" in line


def test_train_takes_a_preset_not_a_file(checkpoint, capsys):
    line = one_line_error(capsys, main(["train", "--model", str(checkpoint), "--steps", "1"]))
    assert "is a checkpoint; this command builds fresh weights from a preset" in line


def test_serve_names_the_spelling_typed(capsys):
    assert "--max-tokens must be at least 1" in one_line_error(capsys, main(["serve", "--max-tokens", "0"]))
    line = one_line_error(capsys, main(["serve", "--default-max-new-tokens", "0"]))
    assert "--default-max-new-tokens must be at least 1; got 0" in line


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--eval", "held.jsonl"], "--eval"),
        (["--model", "m.gguf", "--data", "d.jsonl"], "--model, --data"),
        (["--steps", "3", "--lora-rank", "2"], "--steps"),
    ],
)
def test_a_refused_resume_names_flags_that_exist(flags, named, tmp_path, capsys):
    line = one_line_error(capsys, main(["finetune", "--resume", "--out", str(tmp_path), *flags]))
    assert f"drop {named} (or start a new --out)" in line
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    shown = {
        s for a in commands.choices["finetune"]._actions if a.help is not argparse.SUPPRESS for s in a.option_strings
    }
    for flag in re.findall(r"--[a-z][a-z-]*", line.split("drop ", 1)[1]):
        assert flag in shown


def test_a_refused_train_resume_names_the_model_flags(tmp_path, capsys):
    argv = ["train", "--resume", "--out", str(tmp_path), "--preset", "tiny", "--n-layers", "3", "--bf16"]
    line = one_line_error(capsys, main(argv))
    assert "drop --bf16, --preset, --n-layers (or start a new --out)" in line


def test_threads_reach_torch(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert main(["check", "--model", "tiny", "--threads", "3", "--json"]) == 0
    assert calls == [3]
    assert "--threads must be a positive integer; got 0" in one_line_error(
        capsys, main(["trace", "--model", "tiny", "--threads", "0"]), empty_stdout=False
    )


def test_generate_needs_a_model(capsys):
    line = one_line_error(capsys, main(["generate", "--prompt", "a"]))
    assert "generate needs --model SOURCE" in line


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--exact", "--int8"], "--exact runs the float32 model, and --int8 rounds it"),
        (["--exact", "--cache-dtype", "bfloat16"], "--cache-dtype bfloat16 rounds it"),
        (["--exact", "--cache-dtype", "float16"], "--cache-dtype float16 rounds it"),
        (["--exact", "--bf16"], "argument --bf16: not allowed with argument --exact"),
        (["--bf16", "--dtype", "float32"], "not allowed with argument --bf16"),
    ],
)
def test_generate_refuses_rounding_beside_exact(checkpoint, argv, match, capsys):
    code = main(["generate", "--model", str(checkpoint), "--prompt", "a", *argv])
    assert match in one_line_error(capsys, code, empty_stdout=False)


def test_generate_exact_and_bf16_load_what_dtype_loads(checkpoint, capsys, monkeypatch):
    from oneblock.inference import load as load_module

    seen = []
    real = load_module.load_model

    def spy(source, **kwargs):
        seen.append(kwargs["dtype"])
        return real(source, **kwargs)

    monkeypatch.setattr(load_module, "load_model", spy)
    runs = {}
    for flags in (["--exact"], ["--dtype", "float32"], ["--bf16"], ["--dtype", "bfloat16"]):
        argv = ["generate", "--model", str(checkpoint), "--prompt", "ab", "--greedy", "--max-new-tokens", "4"]
        runs[" ".join(flags)] = _json(capsys, [*argv, *flags, "--json"])["new_ids"]
    assert seen == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    assert runs["--exact"] == runs["--dtype float32"] and runs["--bf16"] == runs["--dtype bfloat16"]


def test_finetune_exact_is_float32_throughout(capsys):
    line = one_line_error(capsys, main(["finetune", "--exact", "--bf16", "--model", "m", "--data", "d", "--out", "o"]))
    assert "--exact computes in float32 throughout and --bf16 in bfloat16; give one of them" in line
    args = build_parser().parse_args(["finetune", "--exact"])
    from oneblock.cli.precision import weights_dtype

    assert weights_dtype(args, training=True) == "float32"
    assert weights_dtype(build_parser().parse_args(["finetune", "--bf16"]), training=True) is None  # autocast only


def test_the_parsers_build_with_argparse_semantics():
    """An alias default never overrides the one name's default."""
    args = build_parser().parse_args(["serve"])
    assert args.default_max_new_tokens == 512 and not hasattr(args, "max_tokens")
    args = build_parser().parse_args(["finetune"])
    assert (args.lora_rank, args.lora_alpha, args.lora_targets) == (8, 16.0, "q,k,v,o,gate,up,down")
    assert isinstance(build_parser(), argparse.ArgumentParser)
