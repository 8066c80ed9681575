"""The GGML tensor types: id, name, values per block and bytes per block, without importing the ``gguf`` package.

Reading a file needs every tensor's byte count (where the next tensor starts), so the reader must know the size
of every type a file may hold, even one oneblock cannot decode (refused later, by name). This table is the
``gguf`` package's ``GGML_QUANT_SIZES`` (version 0.19), which llama.cpp maintains beside ``ggml.h``; a test holds
it equal to the installed package's. A type id missing here is looked up in the ``gguf`` package (a newer one may
know it); importing that package costs about a tenth of a second, which the common types do not pay.
"""

from __future__ import annotations

# id -> (name, values per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 6, 7, 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23


def type_info(type_id: int) -> tuple[str, int, int] | None:
    """``(name, values per block, bytes per block)`` of a GGML type id, or ``None`` when no one knows it (this
    table, then the installed ``gguf`` package)."""
    known = GGML_TYPES.get(type_id)
    if known is not None:
        return known
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        kind = GGMLQuantizationType(type_id)
        block, size = GGML_QUANT_SIZES[kind]
    except (ImportError, ValueError, KeyError):
        return None
    return kind.name, block, size


def type_name(type_id: int) -> str:
    """The name of a GGML type id (``"Q4_1"``), or ``"unknown type id N"``."""
    known = type_info(type_id)
    return known[0] if known is not None else f"unknown type id {type_id}"
