"""GGUF files written byte by byte, for layouts that no well-behaved writer produces."""

from __future__ import annotations

import struct

import numpy as np

U32, I32, F32, STRING, ARRAY = 4, 5, 6, 8, 9
GGML_F32, GGML_Q4_0 = 0, 2


def string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def kv(key: str, kind: int, payload: bytes) -> bytes:
    """One metadata entry: its key, its GGUF value type and the value's bytes."""
    return string(key) + struct.pack("<I", kind) + payload


def u32(key: str, value: int) -> bytes:
    return kv(key, U32, struct.pack("<I", value))


def strings(key: str, values: list[str]) -> bytes:
    return kv(key, ARRAY, struct.pack("<IQ", STRING, len(values)) + b"".join(string(v) for v in values))


def gguf_file(kvs: list[bytes], tensors: list[tuple[str, tuple[int, ...], int, int]], data: bytes, align: int = 32):
    """A GGUF v3 file: ``tensors`` are ``(name, GGUF dims innermost first, GGML type, data offset)``."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs)
    for name, dims, ggml_type, offset in tensors:
        head += string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)
    return head + b"\0" * (-len(head) % align) + data


def two_tensors(offset_b: int = 32, kvs: list[bytes] | None = None, align: int = 32) -> bytes:
    """Tensors ``a`` (ones) and ``b`` (twos), 4 float32 each; ``b`` at ``offset_b`` (its right place is ``align``)."""
    data = bytearray(max(offset_b, 16) + 16 + 32)
    data[0:16] = np.ones(4, np.float32).tobytes()
    data[offset_b : offset_b + 16] = np.full(4, 2, np.float32).tobytes()
    return gguf_file(kvs or [], [("a", (4,), GGML_F32, 0), ("b", (4,), GGML_F32, offset_b)], bytes(data), align)
