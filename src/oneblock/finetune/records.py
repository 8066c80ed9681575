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

Every record is checked as it is read; a bad one is refused with the file and the line (or list index) named. A
file is read at most up to the limit on training texts (``ONEBLOCK_MAX_TEXT_BYTES``, 256 MiB), JSONL a line at a
time.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from oneblock import jsontext
from oneblock.errors import InputError
from oneblock.io import limits
from oneblock.text.checks import check_text

ROLES = ("system", "user", "assistant")
FORMATS = ("chat", "prompt-completion", "alpaca", "text")
SUFFIXES = (".jsonl", ".json", ".txt")


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
    """What a data file holds: its format and records (``text`` instead for a ``.txt`` file).

    Attributes:
        nbytes, sha256: the file's size and digest, as read (what a resumed run checks its data against).
    """

    path: Path
    format: str
    records: tuple[Record, ...] = ()
    text: str | None = None
    nbytes: int = 0
    sha256: str = ""


def read_data(path: str | Path, *, max_bytes: int | None = None) -> Dataset:
    """Read a fine-tuning data file, choosing the format by its suffix and, for JSONL, its first record.

    A JSONL file is read a line at a time; no file is read past the limit on training texts
    (``oneblock.io.limits.text_limit``: ``ONEBLOCK_MAX_TEXT_BYTES``, else 256 MiB), and one whose size is over it
    is refused before any byte is read. Each record is parsed by the bounded JSON reader
    (``oneblock.jsontext``) and its strings checked as text (``oneblock.text.checks.check_text``).

    Args:
        path: the data file.
        max_bytes: the most bytes read (overrides ``ONEBLOCK_MAX_TEXT_BYTES``).

    Raises:
        InputError: a missing, empty or oversized file, malformed or too deeply nested JSON (file and line named),
            a record of no known format, an unknown role, a lone surrogate, a conversation with no assistant
            turn, or a record of another format than the first.
    """
    path = Path(path)
    name = str(path)
    if not path.is_file():
        raise InputError(f"data file {name!r} does not exist or is not a file")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise InputError(
            f"data file {name!r} has the suffix {suffix!r}; use .jsonl (chat or prompt/completion), .json (Alpaca) "
            "or .txt (plain text)"
        )
    limit, source = limits.text_limit(max_bytes)
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise InputError(_too_large(name, f"is {size:,} bytes, over", limit, source))
            if suffix == ".jsonl":
                kind, records, nbytes = _read_jsonl(path, _lines(f, name, limit, source, digest))
                return Dataset(path, kind, records, nbytes=nbytes, sha256=digest.hexdigest())
            raw = f.read(limit + 1)
    except OSError as error:
        raise InputError(f"cannot read the data file {name!r}: {error.strerror or error}") from None
    if len(raw) > limit:
        raise InputError(_too_large(name, "goes on past", limit, source))
    digest.update(raw)
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"data file {name!r} is not UTF-8 (byte {error.start}); convert it to UTF-8") from None
    if not content.strip():
        raise InputError(f"data file {name!r} is empty; it needs at least one example")
    if suffix == ".txt":
        return Dataset(path, "text", text=content, nbytes=len(raw), sha256=digest.hexdigest())
    return Dataset(path, "alpaca", _read_alpaca(path, content), nbytes=len(raw), sha256=digest.hexdigest())


def _too_large(name: str, told: str, limit: int, source: str) -> str:
    return (
        f"data file {name!r} {told} the limit of {limit:,} bytes ({source}); train on a part of it, or raise the "
        f"limit with {limits.ENV_MAX_TEXT_BYTES}"
    )


def _lines(f: BinaryIO, name: str, limit: int, source: str, digest: Any) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of an open file, never reading more than ``limit`` bytes in all."""
    total = 0
    for number in itertools.count(1):
        line = f.readline(limit - total + 1)
        if not line:
            return
        total += len(line)
        if total > limit:
            raise InputError(_too_large(name, "goes on past", limit, source))
        digest.update(line)
        yield number, line


def _read_jsonl(path: Path, lines: Iterator[tuple[int, bytes]]) -> tuple[str, tuple[Record, ...], int]:
    """``(format, records, bytes read)`` of a JSONL file's lines."""
    records: list[Record] = []
    kind: str | None = None
    nbytes = 0
    for number, line in lines:
        nbytes += len(line)
        if not line.strip():
            continue
        where = f"{path}:{number}"
        obj = jsontext.loads(line, what=f"{where}: the record", error=InputError)
        record, this = _record(obj, where)
        if kind is None:
            kind = this
        elif this != kind:
            raise InputError(f"{where}: a {this} record in a file of {kind} records; use one format per file")
        records.append(record)
    if not records:
        raise InputError(f"data file {str(path)!r} is empty; it needs at least one example")
    return kind or "chat", tuple(records), nbytes


def _read_alpaca(path: Path, content: str) -> tuple[Record, ...]:
    what = f"{path}: the Alpaca file (one JSON list of {{'instruction', 'input', 'output'}} objects)"
    obj = jsontext.loads(content, what=what, error=InputError)
    if not isinstance(obj, list) or not obj:
        raise InputError(f"{path}: an Alpaca file must hold a non-empty JSON list of records; got {type(obj).__name__}")
    records = []
    for i, item in enumerate(obj):
        where = f"{path}[{i}]"
        if not isinstance(item, dict) or not {"instruction", "output"} <= set(item):
            raise InputError(f"{where}: an Alpaca record needs 'instruction' and 'output' (and may have 'input')")
        instruction, extra, output = item["instruction"], item.get("input", ""), item["output"]
        for key, value in (("instruction", instruction), ("input", extra), ("output", output)):
            _check_string(value, f"{where}: {key!r}")
        user = f"{instruction}\n\n{extra}" if extra else instruction  # Alpaca's own prompt joins them so
        messages = ({"role": "user", "content": user}, {"role": "assistant", "content": output})
        records.append(Record(where, messages=messages))
    return tuple(records)


def _check_string(value: Any, what: str) -> str:
    """``value`` if it is a string of valid Unicode (no lone surrogate, which no tokenizer can encode)."""
    if not isinstance(value, str):
        raise InputError(f"{what} must be a string; got {type(value).__name__}")
    return check_text(value, what)


def _record(obj: Any, where: str) -> tuple[Record, str]:
    """One JSONL record and its format."""
    if isinstance(obj, dict) and "messages" in obj:
        return Record(where, messages=_messages(obj["messages"], where)), "chat"
    if isinstance(obj, dict) and {"prompt", "completion"} <= set(obj):
        prompt, completion = obj["prompt"], obj["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise InputError(f"{where}: 'prompt' and 'completion' must be strings")
        check_text(prompt, f"{where}: 'prompt'")
        check_text(completion, f"{where}: 'completion'")
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
        _check_string(content, f"{where}: message {i}'s content")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise InputError(f"{where}: the conversation has no assistant turn, so nothing in it would be trained")
    return tuple(out)
