"""The kernel benchmark's llama.cpp lines and weights: the fields test-backend-ops reads, blocks the kernels read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_kernels
import llamacpp_tools

from oneblock import kernels
from oneblock.kernels.formats import FORMATS

# `test-export-graph-ops -m llama-1b/q4_k_m.gguf -c 512`: a Q4_K and a Q6_K product of one decoding row
EXPORTED = {
    "Qcur-0": "29 0 2048 1 1 1 16 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 2 12 2048 2048 1 1 144 1152 2359296 2359296 "
    "0 2048 1 1 1 4 8192 8192 8192 Qcur-0",
    "result_output": "29 0 49152 1 1 1 16 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 2 14 2048 49152 1 1 210 1680 82575360 "
    "82575360 0 2048 1 1 1 4 8192 8192 8192 result_output",
}


def test_line_reproduces_the_exported_lines() -> None:
    assert llamacpp_tools.mul_mat_line_for(12, 2048, 2048, 1, "Qcur-0") == EXPORTED["Qcur-0"]
    assert llamacpp_tools.mul_mat_line_for(14, 49152, 2048, 1, "result_output") == EXPORTED["result_output"]


@pytest.mark.parametrize("name", sorted(EXPORTED))
@pytest.mark.parametrize("rows", [4, 8])
def test_line_for_m_rows_is_the_exported_line_rewritten(name: str, rows: int) -> None:
    fields = EXPORTED[name].split()
    ggml_type, k, n = int(fields[24]), int(fields[25]), int(fields[26])
    built = llamacpp_tools.mul_mat_line_for(ggml_type, n, k, rows, "x")
    assert built == llamacpp_tools.mul_mat_line(EXPORTED[name], rows, "x")


def test_line_strides_follow_the_type() -> None:
    q8 = llamacpp_tools.mul_mat_line_for(8, 512, 2048, 4, "q8").split()
    assert q8[2:4] == ["512", "4"]  # the output: N x M
    assert q8[24:33] == ["8", "2048", "512", "1", "1", "34", str(64 * 34), str(512 * 64 * 34), str(512 * 64 * 34)]
    assert q8[33:42] == ["0", "2048", "4", "1", "1", "4", "8192", "32768", "32768"]
    iq4 = llamacpp_tools.mul_mat_line_for(23, 2048, 8192, 1, "iq4").split()
    matrix = str(2048 * 32 * 136)
    assert iq4[24:33] == ["23", "8192", "2048", "1", "1", "136", str(32 * 136), matrix, matrix]


def test_ggml_table_agrees_with_the_formats() -> None:
    for spec in FORMATS.values():
        name, block, size = llamacpp_tools.GGML_TYPES[spec.ggml_type]
        assert (name.lower(), block, size) == (spec.name, spec.block, spec.nbytes)


def test_line_refuses_an_unknown_type_and_a_partial_block() -> None:
    with pytest.raises(ValueError, match="no ggml type 99"):
        llamacpp_tools.mul_mat_line_for(99, 32, 32, 1, "x")
    with pytest.raises(ValueError, match="K = 96 is not a multiple"):
        llamacpp_tools.mul_mat_line_for(12, 32, 96, 1, "x")


def test_llama_1b_lines_name_every_product_llama_cpp_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp_tools, "tool", lambda name: Path("/bin") / name)  # as if built
    (group,) = bench_kernels.llama_1b_groups(["q5_k"], [1, 4], torch.Generator().manual_seed(0))
    ops = {op for *_, parts in group.products for op in parts}
    assert ops == {"q5_k-2048x2048", "q5_k-512x2048", "q5_k-8192x2048", "q5_k-2048x8192", "q5_k-49152x2048"}
    assert group.lines is not None
    assert {line.split()[-1] for line in group.lines} == {f"{op}@{m}" for op in ops for m in (1, 4)}
    gate_up = next(line.split() for line in group.lines if line.endswith("q5_k-8192x2048@4"))
    assert gate_up[2:4] == ["8192", "4"] and gate_up[24:27] == ["13", "2048", "8192"]
    stacked = next(p for p in group.products if p[0] == "gate/up stacked")
    assert stacked[1:] == ("q5_k", 16384, 2048, {"q5_k-8192x2048": 2})


@pytest.mark.parametrize("fmt", bench_kernels.LLAMA_1B_TYPES)
def test_random_blocks_decode_to_finite_values(fmt: str) -> None:
    blocks = bench_kernels.random_blocks(fmt, 32, 512, torch.Generator().manual_seed(0))
    spec = FORMATS[fmt]
    assert blocks.shape == (32, 512 // spec.block * spec.nbytes) and blocks.dtype == torch.uint8
    values = kernels.dequantize(blocks, fmt)
    assert values.shape == (32, 512)
    assert torch.isfinite(values).all() and values.abs().max() > 0
