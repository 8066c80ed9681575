"""Sequential reads of a GGUF header's values: little-endian scalars, strings, and arrays of them, each checked
against the end of the buffer (``read_layout`` and the metadata copier read through it).

Numeric arrays come back as read-only numpy views of the buffer; arrays of ``BULK_STRINGS`` strings or more are
decoded at once. A cursor made with ``defer=True`` steps over such arrays at the top level instead, returning
``DEFERRED`` and noting where they lie (``deferred``), for its caller to decode them last.
"""

from __future__ import annotations

import array
import struct
from typing import Any

import numpy as np

from oneblock.io import limits

MAX_ARRAY_DEPTH = 3  # an array of arrays of arrays; llama.cpp reads no nested array at all

# GGUF value type id -> (struct format, numpy dtype) of the scalar types.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7

_U64 = struct.Struct("<Q")
BULK_STRINGS = 64  # arrays of strings from this long on are decoded at once (Cursor.strings)
_LENGTH_TAIL = np.arange(1, 8)  # a length's bytes after its first


class Cursor:
    """Sequential little-endian reads from a buffer, each checked against its end."""

    def __init__(self, buffer: memoryview, max_strings: tuple[int, str], *, defer: bool = False) -> None:
        self.buffer, self.pos = buffer, 0
        self.max_strings, self.limit_source = max_strings
        self.key = ""
        self.defer = defer  # long string arrays stepped over, their values DEFERRED, for read_layout to decode last
        self.deferred: list[tuple[str, int, array.array]] = []  # (key, start, ends) of the arrays left to decode

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buffer):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = str(self.buffer[self.pos : end], "utf-8")
        self.pos = end
        return text

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary, merges): their lengths walked in Python, the bytes decoded at
        once (see :meth:`decode`)."""
        if count < BULK_STRINGS:
            return [self.string() for _ in range(count)]
        return self.decode(*self.walk(count))

    def walk(self, count: int) -> tuple[int, array.array]:
        """Step over ``count`` strings: where they start and where each ends (an ``array`` of int64, not a list of
        ints: those would outlive the walk, scattered among the small-object arenas the strings fill next)."""
        buffer, start = self.buffer, self.pos
        unpack = _U64.unpack_from
        pos = start
        ends = array.array("q")
        keep = ends.append
        for _ in range(count):  # a length past the end makes the next unpack raise struct.error
            pos += 8 + unpack(buffer, pos)[0]
            keep(pos)
        if pos > len(buffer):
            raise ValueError(f"an array of {count} strings runs past the end of the file")
        self.pos = pos
        return start, ends

    def decode(self, start: int, ends: array.array) -> list[str]:
        """The strings :meth:`walk` stepped over. Each string's length is replaced by one NUL, the whole decoded
        strictly (a NUL ends any multi-byte sequence, so a string that is not UTF-8 on its own fails the whole)
        and split at the NULs. An array whose strings hold a NUL themselves, or one that fails to decode, is read
        string by string (which raises the first bad string's own error)."""
        buffer, count, pos = self.buffer, len(ends), ends[-1]
        heads = np.empty(count, dtype=np.int64)  # (count,) where each string's 8-byte length starts, in the array
        heads[0], heads[1:] = 0, np.frombuffer(ends, dtype=np.int64)[:-1] - start
        region = np.frombuffer(buffer, dtype=np.uint8, count=pos - start, offset=start).copy()
        region[heads] = 0  # the separator, in the first byte of each length
        kept = np.ones(pos - start, dtype=np.bool_)
        kept[(heads[:, None] + _LENGTH_TAIL).reshape(-1)] = False  # the other 7 bytes of every length
        joined = region[kept].tobytes()  # NUL, string, NUL, string, ...
        self.pos = start
        if joined.count(0) != count:
            return [self.string() for _ in range(count)]
        try:
            parts = joined.decode("utf-8").split("\0")
        except UnicodeDecodeError:
            return [self.string() for _ in range(count)]  # raises the first bad string's UnicodeDecodeError
        self.pos = pos
        return parts[1:]

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array(depth + 1)
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(_SCALARS[kind][0])

    def array(self, depth: int) -> Any:
        if depth > MAX_ARRAY_DEPTH:
            raise ValueError(f"metadata {self.key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        item, count = self.scalar("<I"), self.scalar("<Q")
        left = len(self.buffer) - self.pos
        if item in _SCALARS:  # numbers: a read-only view of the file, not one Python object per value
            dtype = np.dtype(_SCALARS[item][1])
            if count * dtype.itemsize > left:
                raise ValueError(f"an array of {count} values runs past the end of the file")
            values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            values = values.view(np.bool_) if item == _BOOL else values
            values.flags.writeable = False
            return values
        if item == _STRING:
            if count > left // 8:  # each string is at least its 8-byte length
                raise ValueError(f"an array of {count} strings runs past the end of the file")
            if count > self.max_strings:
                raise TooMany(
                    f"GGUF metadata {self.key!r} holds {count:,} strings, over the limit of {self.max_strings:,} "
                    f"({self.limit_source}); if the file is genuine, raise the limit with max_vocab= or "
                    f"{limits.ENV_MAX_VOCAB}"
                )
            if self.defer and depth == 1 and count >= BULK_STRINGS:  # a vocabulary: read_layout decodes it last
                start, ends = self.walk(count)
                self.deferred.append((self.key, start, ends))
                return DEFERRED
            return self.strings(count)
        if item == _ARRAY:
            if count > left // 12:  # each array is at least its type and count
                raise ValueError(f"an array of {count} arrays runs past the end of the file")
            return [self.array(depth + 1) for _ in range(count)]
        raise ValueError(f"metadata {self.key!r} is an array of unknown GGUF value type {item}")


DEFERRED = object()  # the value of a vocabulary array until read_layout decodes it


class TooMany(ValueError):
    """An array over a limit: told as it is, not as a corrupt file."""
