"""oneblock's GGUF reader against the ``gguf`` package's, and the parts of it that do not import that package.

The real SmolLM2 file is read by both: every metadata key and value (the 49,152-token vocabulary and its merges
included, which oneblock decodes in one pass), every tensor's name, shape, type and offset. The table of GGML type
sizes equals the package's; arrays of strings with a bad string in them are refused or read as the
string-by-string path reads them; and the generate path (``load_model`` of a GGUF file) never imports ``gguf``
(nor ``safetensors``, ``jinja2`` or the chat template's module).
"""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf_bytes import ARRAY, STRING, gguf_file, kv, string

from oneblock.errors import CheckpointError
from oneblock.io.gguf import types
from oneblock.io.gguf.cursor import BULK_STRINGS
from oneblock.io.gguf.layout import read_layout

gguf = pytest.importorskip("gguf")


def test_the_type_table_is_the_gguf_packages():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    assert {k.value: (k.name, *GGML_QUANT_SIZES[k]) for k in GGMLQuantizationType} == types.GGML_TYPES
    for name in ("F32", "F16", "Q4_0", "Q4_1", "Q8_0", "BF16", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q6_K"):
        assert getattr(types, name) == GGMLQuantizationType[name].value
    assert types.type_info(3) == ("Q4_1", 32, 20)
    assert types.type_info(10_000) is None and types.type_name(10_000) == "unknown type id 10000"


def test_smollm2_reads_as_the_gguf_package_reads_it():
    from oneblock.inference.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    layout, reader = read_layout(path), gguf.GGUFReader(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(layout.metadata) == keys
    for key in keys:
        ours, theirs = layout.metadata[key], reader.fields[key].contents()
        assert (ours.tolist() if isinstance(ours, np.ndarray) else ours) == theirs, key
        assert type(theirs) is type(ours) or isinstance(ours, np.ndarray), key
    assert len(layout.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(layout.metadata["tokenizer.ggml.merges"]) == 48900
    assert list(layout.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = layout.tensors[t.name]
        assert ours.shape == tuple(int(n) for n in reversed(t.shape.tolist())), t.name
        assert ours.ggml_type == t.tensor_type, t.name
        assert ours.offset == t.data_offset, t.name
        assert ours.data.numel() == t.n_bytes, t.name
    assert layout.data_start == min(t.data_offset for t in reader.tensors)


def _vocab_file(tmp_path, payloads: list[bytes]) -> object:
    """A file whose only metadata is an array of strings with these raw bytes (not necessarily UTF-8)."""
    items = b"".join(struct.pack("<Q", len(p)) + p for p in payloads)
    entry = kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, len(payloads)) + items)
    path = tmp_path / "v.gguf"
    path.write_bytes(gguf_file([entry, kv("general.name", STRING, string("v"))], [], b""))
    return path


@pytest.mark.parametrize("count", [3, BULK_STRINGS, 1000])
def test_arrays_of_strings_read_every_string_exactly(tmp_path, count):
    words = [f"w{i}" for i in range(count)]
    words[1] = ""  # empty strings, multi-byte characters, spaces and newlines, a NUL inside a string
    words[2] = "Ġé世界🙂 a\nb"
    if count > 3:
        words[count // 2] = "nul\0inside"
    layout = read_layout(_vocab_file(tmp_path, [w.encode() for w in words]))
    assert layout.metadata["tokenizer.ggml.tokens"] == words
    assert layout.metadata["general.name"] == "v"  # the cursor stands right after the array


@pytest.mark.parametrize("bad", [b"\xff", b"\xc3", b"ab\xe4\xb8", b"\xed\xa0\x80", b"\x80x"])
@pytest.mark.parametrize("where", [0, 500, 999])
def test_a_string_that_is_not_utf8_is_refused_anywhere_in_a_long_array(tmp_path, bad, where):
    payloads = [f"t{i}".encode() for i in range(1000)]
    payloads[where] = bad
    with pytest.raises(CheckpointError, match=r"is a corrupt or truncated GGUF file: .*codec can't decode"):
        read_layout(_vocab_file(tmp_path, payloads))


def test_a_string_split_across_two_entries_is_not_glued_back(tmp_path):
    payloads = [f"t{i}".encode() for i in range(100)]
    payloads[10], payloads[11] = "é".encode()[:1], "é".encode()[1:]  # valid UTF-8 only if read together
    with pytest.raises(CheckpointError, match="codec can't decode"):
        read_layout(_vocab_file(tmp_path, payloads))


def test_an_array_of_strings_running_past_the_end_is_refused(tmp_path):
    path = _vocab_file(tmp_path, [f"t{i}".encode() for i in range(200)])
    data = path.read_bytes()
    at = data.index(struct.pack("<Q", 4) + b"t150")
    path.write_bytes(data[:at] + struct.pack("<Q", 1 << 40) + data[at + 8 :])
    with pytest.raises(CheckpointError, match="is a corrupt or truncated GGUF file"):
        read_layout(path)


def test_loading_a_gguf_model_does_not_import_the_gguf_package():
    code = (
        "import sys\n"
        "from oneblock.inference.load import load_model\n"
        "from oneblock.inference.smollm2 import smollm2_gguf_path\n"
        "loaded = load_model(smollm2_gguf_path())\n"
        "ids = loaded.tokenizer.encode('Hello')\n"
        "names = ('gguf', 'jinja2', 'safetensors', 'torch._dynamo', 'oneblock.text.chat_template')\n"
        "print([name for name in names if name in sys.modules], len(ids))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "1"]
