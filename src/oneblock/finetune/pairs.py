"""Preference data for DPO: one ``{"prompt" or "messages", "chosen", "rejected"}`` object per JSONL line.

``prompt`` is the user's message (a string); ``messages`` instead is the conversation so far (system, user and
assistant turns, ending with the user's), as in chat data. ``chosen`` and ``rejected`` are the two answers, as
strings. Each pair becomes two tokenized examples that share the prompt, rendered exactly as supervised data is
(``oneblock.finetune.tokenize``): the model's chat template, with only the answer and its end-of-turn token
trained, that is, counted in the answer's log-probability.

Shape notation: N tokens of one example, T the training window (``seq_len``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oneblock import jsontext
from oneblock.errors import InputError
from oneblock.finetune.records import ROLES, Record
from oneblock.finetune.tokenize import Example, encode_record
from oneblock.io import limits
from oneblock.text.checks import check_text
from oneblock.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class PairRecord:
    """One preference pair before tokenization: the prompt (a string, or the conversation so far), two answers."""

    where: str
    chosen: str
    rejected: str
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

    def as_record(self, answer: str) -> Record:
        """The supervised record of the prompt followed by ``answer``."""
        if self.messages is not None:
            return Record(self.where, messages=(*self.messages, {"role": "assistant", "content": answer}))
        return Record(self.where, prompt=self.prompt, completion=answer)


@dataclass(frozen=True)
class PairExample:
    """A tokenized pair: the prompt with the chosen answer, and with the rejected one."""

    chosen: Example
    rejected: Example
    where: str


def read_pairs(path: str | Path) -> list[PairRecord]:
    """Read a JSONL file of preference pairs.

    Raises:
        InputError: a missing, empty or non-UTF-8 file, a suffix other than ``.jsonl``, malformed JSON, or a line
            that is not a pair (file and line named).
    """
    path = Path(path)
    name = str(path)
    if path.suffix.lower() != ".jsonl":
        raise InputError(f"preference data {name!r} must be a .jsonl file of {{prompt, chosen, rejected}} lines")
    if not path.is_file():
        raise InputError(f"preference data {name!r} does not exist or is not a file")
    limit, source = limits.text_limit()
    if path.stat().st_size > limit:
        raise InputError(
            f"preference data {name!r} is {path.stat().st_size:,} bytes, over the limit of {limit:,} ({source}); "
            "raise it with ONEBLOCK_MAX_TEXT_BYTES"
        )
    try:
        content = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise InputError(f"cannot read the preference data {name!r}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise InputError(f"preference data {name!r} is not UTF-8 (byte {error.start}); convert it") from None
    pairs = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        obj = jsontext.loads(line, what=where)  # bounded: depth, digits and size
        pairs.append(pair_record(obj, where))
    if not pairs:
        raise InputError(f"preference data {name!r} is empty; it needs at least one pair")
    return pairs


def pair_record(obj: Any, where: str) -> PairRecord:
    """One pair from a decoded JSON object, checked."""
    if not isinstance(obj, dict) or not {"chosen", "rejected"} <= set(obj) or ("prompt" in obj) == ("messages" in obj):
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise InputError(
            f"{where}: a preference pair is {{'prompt' (or 'messages'), 'chosen', 'rejected'}}, with exactly one of "
            f"'prompt' and 'messages'; got {keys}"
        )
    for key in ("chosen", "rejected"):
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise InputError(f"{where}: {key!r} must be a non-empty string, the answer's text")
        check_text(obj[key], f"{where}: {key!r}")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise InputError(f"{where}: 'prompt' must be a string; got {type(obj['prompt']).__name__}")
        check_text(obj["prompt"], f"{where}: 'prompt'")
        return PairRecord(where, obj["chosen"], obj["rejected"], prompt=obj["prompt"])
    return PairRecord(where, obj["chosen"], obj["rejected"], messages=_prompt_messages(obj["messages"], where))


def _prompt_messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise InputError(f"{where}: message {i} must be an object with 'role' and a string 'content'")
        if message.get("role") not in ROLES:
            raise InputError(f"{where}: message {i} has the role {message.get('role')!r}; roles are {', '.join(ROLES)}")
        check_text(message["content"], f"{where}: message {i}")
        out.append({"role": message["role"], "content": message["content"]})
    if out[-1]["role"] != "user":
        raise InputError(f"{where}: 'messages' must end with the user's turn, which 'chosen' and 'rejected' answer")
    return tuple(out)


def build_pairs(records: list[PairRecord], tokenizer: Tokenizer, *, seq_len: int) -> list[PairExample]:
    """Tokenize every pair for windows of ``seq_len`` inputs (each answer's example has N - 1 <= T).

    Raises:
        InputError: a pair whose longer example exceeds the window (named, with its length), or an answer with no
            trained token.
    """
    out = []
    for record in records:
        chosen = encode_record(record.as_record(record.chosen), tokenizer)
        rejected = encode_record(record.as_record(record.rejected), tokenizer)
        longest = max(len(chosen.ids), len(rejected.ids)) - 1
        if longest > seq_len:
            raise InputError(
                f"{record.where}: the pair needs {longest} positions, more than seq_len {seq_len}; raise seq_len "
                "or shorten the pair (pairs are never truncated: a cut answer is another answer)"
            )
        if not chosen.n_trained or not rejected.n_trained:
            raise InputError(f"{record.where}: an answer renders to no trained token; check the pair")
        out.append(PairExample(chosen, rejected, record.where))
    return out
