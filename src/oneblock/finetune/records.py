"""Reading fine-tuning data in the formats users already have, as records of one of two kinds.

==========================  =========================================================  =========================
file                        one record                                                 becomes
==========================  =========================================================  =========================
``*.jsonl`` chat            ``{"messages": [{"role": ..., "content": ...}, ...]}``     a conversation
``*.jsonl`` prompt pairs    ``{"prompt": ..., "completion": ...}``                     a conversation (user,
                                                                                       assistant), or text
``*.json`` Alpaca           a list of ``{"instruction", "input", "output"}``           a conversation
``*.txt``                   the whole file                                             text, every token trained
==========================  =========================================================  =========================

Every record is checked as it is read; a bad one is refused with the file and the line (or list index) named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oneblock.errors import InputError

ROLES = ("system", "user", "assistant")
FORMATS = ("chat", "prompt-completion", "alpaca", "text")


@dataclass(frozen=True)
class Record:
    """One training example before tokenization.

    Attributes:
        messages: the conversation, ``({"role": ..., "content": ...}, ...)``; every assistant turn is trained.
        prompt, completion: a prompt/completion pair; only the completion is trained.
        where: ``FILE:LINE`` (or ``FILE[INDEX]``), for messages.
    """

    where: str
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None
    completion: str | None = None


@dataclass(frozen=True)
class Dataset:
    """What a data file holds: its format and records (``text`` instead for a ``.txt`` file)."""

    path: Path
    format: str
    records: tuple[Record, ...] = ()
    text: str | None = None


def read_data(path: str | Path) -> Dataset:
    """Read a fine-tuning data file, choosing the format by its suffix and, for JSONL, its first record.

    Raises:
        InputError: a missing or empty file, malformed JSON (file and line named), a record of no known format,
            an unknown role, a conversation with no assistant turn, or a record of another format than the first.
    """
    path = Path(path)
    name = str(path)
    if not path.is_file():
        raise InputError(f"data file {name!r} does not exist or is not a file")
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise InputError(f"cannot read the data file {name!r}: {error.strerror or error}") from None
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"data file {name!r} is not UTF-8 (byte {error.start}); convert it to UTF-8") from None
    if not content.strip():
        raise InputError(f"data file {name!r} is empty; it needs at least one example")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return Dataset(path, "text", text=content)
    if suffix == ".jsonl":
        return _read_jsonl(path, content)
    if suffix == ".json":
        return _read_alpaca(path, content)
    raise InputError(
        f"data file {name!r} has the suffix {suffix!r}; use .jsonl (chat or prompt/completion), .json (Alpaca) "
        "or .txt (plain text)"
    )


def _read_jsonl(path: Path, content: str) -> Dataset:
    records: list[Record] = []
    kind: str | None = None
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"{where}: malformed JSON ({error.msg} at column {error.colno}); fix the line") from None
        record, this = _record(obj, where)
        if kind is None:
            kind = this
        elif this != kind:
            raise InputError(f"{where}: a {this} record in a file of {kind} records; use one format per file")
        records.append(record)
    return Dataset(path, kind or "chat", tuple(records))


def _read_alpaca(path: Path, content: str) -> Dataset:
    try:
        obj = json.loads(content)
    except json.JSONDecodeError as error:
        raise InputError(
            f"{path}:{error.lineno}: malformed JSON ({error.msg} at column {error.colno}); an Alpaca file is one "
            "JSON list of {'instruction', 'input', 'output'} objects"
        ) from None
    if not isinstance(obj, list) or not obj:
        raise InputError(f"{path}: an Alpaca file must hold a non-empty JSON list of records; got {type(obj).__name__}")
    records = []
    for i, item in enumerate(obj):
        where = f"{path}[{i}]"
        if not isinstance(item, dict) or not {"instruction", "output"} <= set(item):
            raise InputError(f"{where}: an Alpaca record needs 'instruction' and 'output' (and may have 'input')")
        instruction, extra, output = item["instruction"], item.get("input", ""), item["output"]
        for key, value in (("instruction", instruction), ("input", extra), ("output", output)):
            if not isinstance(value, str):
                raise InputError(f"{where}: {key!r} must be a string; got {type(value).__name__}")
        user = f"{instruction}\n\n{extra}" if extra else instruction  # Alpaca's own prompt joins them so
        messages = ({"role": "user", "content": user}, {"role": "assistant", "content": output})
        records.append(Record(where, messages=messages))
    return Dataset(path, "alpaca", tuple(records))


def _record(obj: Any, where: str) -> tuple[Record, str]:
    """One JSONL record and its format."""
    if isinstance(obj, dict) and "messages" in obj:
        return Record(where, messages=_messages(obj["messages"], where)), "chat"
    if isinstance(obj, dict) and {"prompt", "completion"} <= set(obj):
        prompt, completion = obj["prompt"], obj["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise InputError(f"{where}: 'prompt' and 'completion' must be strings")
        return Record(where, prompt=prompt, completion=completion), "prompt-completion"
    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
    raise InputError(
        f"{where}: a record must be {{'messages': [...]}} or {{'prompt': ..., 'completion': ...}}; got {keys}"
    )


def _messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise InputError(f"{where}: message {i} must be an object with 'role' and 'content'")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise InputError(f"{where}: message {i} has the unknown role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise InputError(f"{where}: message {i}'s content must be a string; got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise InputError(f"{where}: the conversation has no assistant turn, so nothing in it would be trained")
    return tuple(out)
