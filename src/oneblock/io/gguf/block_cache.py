"""A verified on-disk cache of the block matrices ``from_gguf`` builds: a second load maps them instead of
repacking them.

The repack (query/key/value and gate/up stacked, the query/key rows reordered, the rows interleaved 16 at a time;
:mod:`oneblock.io.gguf.quantized`) copies every matrix of the file once: 97 MB for SmolLM2-135M, most of a load's
time, spent mostly on the first touch of the new pages. Its result depends only on the file's bytes and on
oneblock's code, so the first load writes it to ``$XDG_CACHE_HOME/oneblock/gguf/<digest of the path>.blocks``
(default ``~/.cache``) and later loads map that file: its pages come from the page cache, shared by every process
that loads the model, and a page is read when a product first needs it.

Keyed and verified, so that a cache never stands in for a file it was not made from:

- The header records the GGUF file the entry was made from (its absolute path, device, inode, size, and mtime and
  ctime in nanoseconds, taken from the open file; the SHA-256 of its header, i.e. the metadata and the tensor
  table), the version of this format, a digest of the code that lays the blocks out (``_CODE``), and whether
  the rows are interleaved (the PyTorch fallback does not interleave). Anything different: rebuilt.
- The header carries its own SHA-256, the file its exact size, every matrix its CRC-32, all checked on every
  load (the CRCs read the 97 MB once, about 25-40 ms, pages the first token would read anyway). An entry that
  fails a check is reported in one line on stderr, rebuilt from the GGUF file and replaced.
- Written atomically (:func:`oneblock.io.files.write_atomic`): a reader sees no entry, the old one or the new one;
  a process that has mapped the old one keeps reading it. Only files of the cache's directory that carry its
  name pattern and magic are replaced or removed (an entry whose GGUF file no longer exists, when another is
  written); the GGUF file itself is only ever read.

``ONEBLOCK_GGUF_CACHE=0`` (or ``off``) disables the cache, any other value is the directory to use;
``from_gguf(..., cache=False)`` skips it for one load. Models with under ``MIN_BYTES`` of block matrices are
not cached (their repack is quick), nor is anything when the disk has less than twice the entry's size free.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
import stat
import struct
import sys
import time
import zlib
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oneblock import jsontext, kernels
from oneblock.errors import CheckpointError, OneBlockError
from oneblock.io.files import TMP_PATTERN, prefer_huge_pages, special_kind, write_atomic
from oneblock.io.gguf.layout import GGUFLayout
from oneblock.layers.quantized import BlockEmbedding, BlockLinear

ENV = "ONEBLOCK_GGUF_CACHE"
MAGIC = b"OBBLOCK1"
VERSION = 1
MIN_BYTES = 4 << 20
SUFFIX = ".blocks"
_NAME = re.compile(r"[0-9a-f]{24}\.blocks")
_PREFIX = struct.Struct("<8sQ32s")  # magic, header length, SHA-256 of the header
_MAX_HEADER = 1 << 24
_ALIGN = 4096  # every matrix starts on a page of the file
_STALE_TMP = 3600.0  # seconds after which a temporary file of the directory is an interrupted write's
_OFF = ("0", "off", "false", "no")
# O_NONBLOCK: a FIFO put where an entry goes opens at once instead of waiting for a writer (and is then refused).
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_HERE = Path(__file__).parent
_KERNELS = Path(kernels.__file__).parent
# The code whose output an entry holds: a change to any of these files makes every entry stale.
_CODE = (
    _HERE / "quantized.py",
    _HERE / "load.py",
    Path(__file__),
    _KERNELS / "interleave.py",
    _KERNELS / "formats.py",
    _KERNELS / "csrc" / "interleave.cpp",
    _KERNELS / "csrc" / "interleaved.h",  # the layouts' chunk order
)

Modules = dict[str, tuple[nn.Module, list[str]]]
"""``block_modules``' result: module name -> (module, the state_dict names it stands for)."""


def cache_directory() -> Path | None:
    """The cache's directory, or ``None`` when ``ONEBLOCK_GGUF_CACHE`` turns it off."""
    value = os.environ.get(ENV)
    if value is None:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "oneblock" / "gguf"
    if not value.strip() or value.strip().lower() in _OFF:
        return None
    return Path(value).expanduser()


def entry_path(directory: Path, source: Path) -> Path:
    """The entry of the GGUF file ``source``: one per absolute path, replaced when the file changes."""
    return directory / (hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:24] + SUFFIX)


def cached_modules(
    layout: GGUFLayout, build: Callable[[], Modules], *, interleaved: bool, enabled: bool = True
) -> Modules:
    """The block modules of ``layout``: mapped from a verified cache entry, or ``build()`` and then cached.

    Args:
        layout: the parsed GGUF file (``read_layout``).
        build: makes the modules from the file (``block_modules``).
        interleaved: whether ``build`` interleaves the rows (the C++ kernels are loaded).
        enabled: ``False`` calls ``build`` and touches no cache.

    Returns:
        ``build()``'s result, or modules holding the same bytes as views of the cache entry.
    """
    directory = cache_directory() if enabled else None
    if directory is None or not layout.identity or layout.mapped is None:
        return build()
    path = entry_path(directory, layout.path)
    kind = special_kind(path)
    if kind is not None:  # never opened (a FIFO would wait for a writer forever), never replaced
        _note(f"the block cache entry {str(path)!r} is {kind}, not a regular file; the model is loaded without the "
              "cache (remove it to cache again)")  # fmt: skip
        return build()
    key = _key(layout, interleaved)
    found = _load(path, key)
    if isinstance(found, dict):
        return found
    if found is not None:
        _note(f"the block cache {str(path)!r} {found}; rebuilding it")
    modules = build()
    _store(path, key, modules)
    return modules


@lru_cache(maxsize=1)
def _code_digest() -> str:
    digest = hashlib.sha256(f"{VERSION}".encode())
    for source in _CODE:
        with contextlib.suppress(OSError):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def _key(layout: GGUFLayout, interleaved: bool) -> dict[str, Any]:
    """What an entry must record to stand for ``layout``'s file."""
    assert layout.mapped is not None
    device, inode, size, mtime_ns, ctime_ns = layout.identity
    header = hashlib.sha256(memoryview(layout.mapped)[: layout.data_start]).hexdigest()
    return {
        "version": VERSION,
        "code": _code_digest(),
        "source": str(layout.path.resolve()),
        "device": device,
        "inode": inode,
        "size": size,
        "mtime_ns": mtime_ns,
        "ctime_ns": ctime_ns,
        "header_sha256": header,
        "interleaved": interleaved,
    }


def _read_header(fd: int, size: int, what: str) -> tuple[dict[str, Any], int] | str:
    """An entry's header and where its data starts, or why it is not a whole entry of this format."""
    prefix = os.pread(fd, _PREFIX.size, 0)
    if len(prefix) < _PREFIX.size:
        return "is shorter than its header"
    magic, length, digest = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        return "is not a block cache of this oneblock"
    if length > min(_MAX_HEADER, size - _PREFIX.size):
        return f"records a header of {length} bytes in a file of {size}"
    raw = os.pread(fd, length, _PREFIX.size)
    if len(raw) != length or hashlib.sha256(raw).digest() != digest:
        return "has a header that does not match its SHA-256"
    try:
        header = jsontext.loads(raw, what=what, error=CheckpointError)
    except CheckpointError as error:
        return f"has an unreadable header ({error})"
    if not isinstance(header, dict):
        return "has a header that is not a JSON object"
    return header, _align(_PREFIX.size + length)


def _load(path: Path, key: dict[str, Any]) -> Modules | str | None:
    """The entry's modules; ``None`` when there is no entry or it is stale; the reason when it does not verify."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"cannot be opened ({error.strerror or error})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        read = _read_header(fd, st.st_size, repr(str(path)))
        if isinstance(read, str):
            return read
        header, start = read
        recorded = header.get("key")
        if recorded != key:  # made from an earlier version of the file, or by other code: stale, not damaged
            same = isinstance(recorded, dict) and recorded.get("source") == key["source"]
            return None if same else "was made from another file"
        data_bytes = header.get("data_bytes")
        if not isinstance(data_bytes, int) or st.st_size != start + data_bytes:
            return f"is {st.st_size} bytes long, not the {start} + {data_bytes} its header records"
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # copy-on-write: nothing is ever written back
        prefer_huge_pages(mapped)  # before the CRC-32 check reads it in
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    finally:
        os.close(fd)
    try:
        return _modules(mapped, header, start)
    except (OneBlockError, KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as error:
        return f"does not hold what its header records ({type(error).__name__}: {error})"


def _modules(mapped: Any, header: dict[str, Any], start: int) -> Modules | str:
    """The modules an entry records, each matrix a view of the mapped entry once its CRC-32 matches."""
    view = memoryview(mapped)
    tensors = []
    for i, record in enumerate(header["tensors"]):
        offset, rows, cols = (int(record[k]) for k in ("offset", "rows", "cols"))
        begin, nbytes = start + offset, rows * cols
        if offset % _ALIGN or offset < 0 or rows <= 0 or cols <= 0 or begin + nbytes > len(mapped):
            return f"records matrix {i} at bytes {begin} to {begin + nbytes} of {len(mapped)}"
        if zlib.crc32(view[begin : begin + nbytes]) != record["crc32"]:
            return f"holds matrix {i} with other bytes than were written (CRC-32 mismatch)"
        tensors.append(torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=begin).view(rows, cols))
    modules: Modules = {}
    for entry in header["modules"]:
        kind = {"linear": BlockLinear, "embedding": BlockEmbedding}[entry["kind"]]
        modules[entry["name"]] = (kind(tensors[entry["tensor"]], entry["fmt"]), [str(n) for n in entry["covers"]])
    return modules


def _store(path: Path, key: dict[str, Any], modules: Modules) -> None:
    """Write ``modules`` as the entry at ``path``; a failure is told on stderr and the load goes on without."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}
    entries = []
    for name, (module, covers) in modules.items():
        if not isinstance(module, (BlockLinear, BlockEmbedding)) or module.blocks.device.type != "cpu":
            return  # nothing else is ever made by block_modules; be safe rather than write half a model
        blocks = module.blocks
        if id(blocks) not in index:
            index[id(blocks)] = len(tensors)
            tensors.append(blocks.contiguous())
        kind = "linear" if isinstance(module, BlockLinear) else "embedding"
        entries.append({"name": name, "kind": kind, "fmt": module.fmt, "tensor": index[id(blocks)], "covers": covers})
    data_bytes = sum(_align(t.numel()) for t in tensors[:-1]) + (tensors[-1].numel() if tensors else 0)
    if data_bytes < MIN_BYTES:
        return
    records, offset = [], 0
    for t in tensors:
        records.append({"offset": offset, "rows": t.shape[0], "cols": t.shape[1], "crc32": zlib.crc32(t.numpy().data)})
        offset = _align(offset + t.numel())
    header = _dumps({"key": key, "data_bytes": data_bytes, "tensors": records, "modules": entries})
    start = _align(_PREFIX.size + len(header))
    chunks: list[bytes | memoryview] = [_PREFIX.pack(MAGIC, len(header), hashlib.sha256(header).digest()), header]
    chunks.append(bytes(start - _PREFIX.size - len(header)))
    for t, record in zip(tensors, records, strict=True):
        chunks.append(t.numpy().data)
        if t is not tensors[-1]:
            chunks.append(bytes(_align(record["offset"] + t.numel()) - record["offset"] - t.numel()))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
    except OSError as error:
        _note(f"cannot use the block cache directory {str(path.parent)!r} ({error.strerror or error}); not cached")
        return
    if free < 2 * (start + data_bytes):
        _note(f"{free:,} bytes free under {str(path.parent)!r}, under twice the block cache's {start + data_bytes:,}")
        return
    try:
        write_atomic(path, chunks, what="GGUF block cache", error=CheckpointError)
    except CheckpointError as error:
        _note(f"{error}; the model is loaded without the cache")
        return
    prune(path.parent, keep=path)


def prune(directory: Path, *, keep: Path | None = None) -> list[Path]:
    """Remove the entries of ``directory`` whose GGUF file no longer exists, or that are damaged, and the
    temporary files of writes interrupted over an hour ago; returns what was removed.

    Only regular files named as entries (24 hex digits, ``.blocks``) whose first bytes are the cache's magic, and
    the temporary names of ``write_atomic``, are ever removed; anything else with such a name (a FIFO, a device, a
    directory) is left alone, unopened, and told on stderr.
    """
    removed = []
    now = time.time()
    for entry in directory.iterdir() if directory.is_dir() else ():
        with contextlib.suppress(OSError):
            named = TMP_PATTERN.fullmatch(entry.name) or _NAME.fullmatch(entry.name)
            if named and not entry.is_symlink() and not stat.S_ISREG(entry.lstat().st_mode):
                _note(f"the block cache directory holds {str(entry)!r}, which is not a regular file; left alone")
                continue
            if TMP_PATTERN.fullmatch(entry.name):
                stale = entry.is_file() and not entry.is_symlink() and now - entry.stat().st_mtime > _STALE_TMP
            else:
                ours = bool(_NAME.fullmatch(entry.name)) and entry != keep and not entry.is_symlink()
                stale = ours and _orphan(entry)
            if stale:
                entry.unlink()
                removed.append(entry)
    return removed


def _orphan(entry: Path) -> bool:
    """Whether an entry is this cache's and either damaged or made from a file that no longer exists."""
    fd = os.open(entry, _OPEN_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        if os.pread(fd, len(MAGIC), 0) != MAGIC:
            return False  # not ours: left alone
        read = _read_header(fd, os.fstat(fd).st_size, repr(str(entry)))
    finally:
        os.close(fd)
    if isinstance(read, str):
        return True
    source = read[0].get("key", {}).get("source")
    return not isinstance(source, str) or not os.path.exists(source)


def _dumps(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _note(message: str) -> None:
    print(f"oneblock: {message}", file=sys.stderr, flush=True)
