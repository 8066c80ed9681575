"""``oneblock generate``, ``oneblock chat`` and ``oneblock serve`` on every decoder family beyond Llama 2, from
llama.cpp's F32 conversion of a user's Hugging Face directory (``converter_testing.made``): the greedy tokens are
those of transformers' ``generate(do_sample=False)`` on the same directory, the chat reply is its greedy
continuation of the rendered template, and ``/v1/completions`` at temperature 0 answers the ``generate`` text
with transformers' log-probabilities.

The converter writes a chat template when the directory's ``tokenizer_config.json`` has one; these have none, so
the chat runs on a copy of the file with the family's template added (``with_chat_template``). Each family's two
files load once for the module; the commands get them through ``load_model`` after the test checks which file and
options they asked for.

Random weights whose embeddings dominate the residual stream (Gemma 2 and 3, Granite) mostly repeat the last token
given, so their greedy tokens say little; the log-probabilities of the completion still check every family's
figures.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from converter_testing import FAMILIES, made
from family_testing import CHATML, GEMMA, LLAMA3, PHI3

from oneblock.cli.main import main
from oneblock.inference import load
from oneblock.text.tokenizer import stop_ids_of

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("gguf")

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "Every block attends, then"
QUESTION = "Name a colour."
NEW_TOKENS = 8
# Granite 3's and OLMo 2 Instruct's turns, shortened to text content; SmolLM3's ChatML without its metadata header
GRANITE = (
    "{%- for message in messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)
OLMO2 = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}"
)
SMOLLM3 = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATES = {
    "qwen2": CHATML, "qwen3": CHATML, "llama3": LLAMA3, "granite": GRANITE, "smollm3": SMOLLM3, "olmo2": OLMO2,
    "phi3": PHI3, "gemma2": GEMMA, "gemma3": GEMMA,
}  # fmt: skip


def with_chat_template(source: Path, target: Path, template: str) -> Path:
    """A copy of the GGUF file ``source`` at ``target`` with ``tokenizer.chat_template`` set to ``template``: the
    entry goes first, after the header, its length brought to a multiple of the file's alignment by a Jinja comment
    (which renders to nothing), so every byte after it keeps its alignment and the tensor data its offsets."""
    from oneblock.io.gguf.layout import read_layout

    alignment = read_layout(source).metadata.get("general.alignment", 32)

    def entry(text: str) -> bytes:
        key, value = b"tokenizer.chat_template", text.encode()
        return struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value  # 8: a string

    filler = -len(entry(template + "{##}")) % alignment
    raw = source.read_bytes()
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    target.write_bytes(
        raw[:8] + struct.pack("<QQ", n_tensors, n_kv + 1) + entry(f"{template}{{#{' ' * filler}#}}") + raw[24:]
    )
    return target


@dataclass
class Family:
    """One family's files, their loads and transformers' model."""

    name: str
    gguf: Path  # the converter's F32 file
    chat_gguf: Path  # the same with the family's chat template
    loaded: dict[Path, Any]  # load_model's answer for each
    reference: Any  # transformers' model of the directory

    @property
    def tokenizer(self) -> Any:
        return self.loaded[self.gguf].tokenizer

    def stops(self) -> tuple[int, ...]:
        return stop_ids_of(self.tokenizer, self.loaded[self.gguf].model.config.eos_token_id)

    def greedy(self, prompt: list[int]) -> list[int]:
        """transformers' greedy continuation of ``prompt``: ``NEW_TOKENS`` ids, or up to and with a stop id."""
        with torch.no_grad():
            out = self.reference.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=list(self.stops()),
                pad_token_id=self.stops()[0], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )  # fmt: skip
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    directory = made(request.param)
    gguf = directory / "f32.gguf"
    chat_gguf = with_chat_template(gguf, tmp_path_factory.mktemp(request.param) / "chat.gguf", TEMPLATES[request.param])
    config = transformers.AutoConfig.from_pretrained(directory)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type") == "longrope":  # oneblock runs the long factors at its full context, as llama.cpp does
        rope["short_factor"] = list(rope["long_factor"])
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, config=config, attn_implementation="eager"
    ).eval()
    loaded = {path: load.load_model(path) for path in (gguf, chat_gguf)}
    return Family(request.param, gguf, chat_gguf, loaded, reference)


@pytest.fixture
def asked(family, monkeypatch) -> list[Path]:
    """The commands get the module's loads; the list records the files they asked for (with no other options)."""
    calls = []

    def load_model(source, prepare=None, **options):
        assert not any(options.values()), options  # no dtype, tokenizer, adapter or context
        calls.append(Path(source))
        loaded = family.loaded[Path(source)]
        return loaded if prepare is None else dataclasses.replace(loaded, tokenizer=prepare(loaded.tokenizer))

    monkeypatch.setattr(load, "load_model", load_model)
    return calls


def run_generate(family: Family, capsys) -> dict:
    argv = ["generate", "--model", str(family.gguf), "--prompt", PROMPT, "--greedy"]
    assert main([*argv, "--max-new-tokens", str(NEW_TOKENS), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_greedy_tokens_are_transformers(family, asked, capsys):
    data = run_generate(family, capsys)
    assert asked == [family.gguf]
    assert data["prompt_ids"] == family.tokenizer.encode(PROMPT)
    expected = family.greedy(data["prompt_ids"])
    assert data["new_ids"] == expected
    assert data["finish_reason"] == ("stop" if expected[-1] in family.stops() else "length")
    assert data["completion"] == family.tokenizer.decode(expected)


def test_chat_reply_is_the_greedy_continuation_of_the_template(family, asked, capsys):
    assert (
        main(
            [
                "chat",
                "--model",
                str(family.chat_gguf),
                "--temperature",
                "0",
                "--max-new-tokens",
                str(NEW_TOKENS),
                QUESTION,
            ]
        )
        == 0
    )
    assert asked == [family.chat_gguf]
    tokenizer = family.loaded[family.chat_gguf].tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=True)
    new = family.greedy(prompt)
    reply = new[:-1] if new[-1] in family.stops() else new
    assert capsys.readouterr().out == tokenizer.decode(reply) + "\n"


def test_serve_completion_is_the_generate_text(family, asked, capsys):
    from serve_testing import Running

    from oneblock.serve.engine import Engine

    generated = run_generate(family, capsys)
    loaded = family.loaded[family.gguf]
    running = Running(Engine(loaded.model, loaded.tokenizer, max_batch=1), model_name=family.name)
    try:
        client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(
            model=family.name, prompt=PROMPT, temperature=0, max_tokens=NEW_TOKENS, logprobs=1
        )
    finally:
        running.close()
    choice = answer.choices[0]
    stopped = generated["finish_reason"] == "stop"
    assert choice.finish_reason == generated["finish_reason"]
    assert choice.text == family.tokenizer.decode(generated["new_ids"][:-1] if stopped else generated["new_ids"])
    assert answer.usage.completion_tokens == len(generated["new_ids"]) - stopped
    # each token's log-probability is transformers': a check that holds also where the greedy tokens repeat
    ids = generated["prompt_ids"] + generated["new_ids"]
    with torch.no_grad():
        table = torch.log_softmax(family.reference(torch.tensor([ids])).logits[0].double(), dim=-1)
    got = choice.logprobs.token_logprobs
    assert 0 < len(got) <= len(generated["new_ids"])
    start = len(generated["prompt_ids"]) - 1
    want = [float(table[start + i, token]) for i, token in enumerate(generated["new_ids"][: len(got)])]
    assert got == pytest.approx(want, abs=1e-4)
