"""The block cache of ``from_gguf``: a second load maps the repacked matrices from a verified entry.

Against the repack itself: the cached model's buffers are the same bytes and its logits the same floats (bit for
bit) on the real SmolLM2 file and on small files; an entry that is damaged anywhere (its data, its header, its
length, a symlink in its place) is told on stderr, rebuilt and replaced, and the load still equals the repack; a
changed GGUF file makes its entry stale; the cache can be turned off; nothing outside the cache's own entries is
ever written or removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf import QUANT, hf_llama, ids, write_gguf  # noqa: E402

from oneblock.io.gguf import block_cache  # noqa: E402
from oneblock.io.gguf.load import from_gguf  # noqa: E402
from oneblock.layers.quantized import BlockEmbedding, BlockLinear  # noqa: E402


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A cache of this test's own, caching models of any size."""
    directory = tmp_path / "cache"
    monkeypatch.setenv(block_cache.ENV, str(directory))
    monkeypatch.setattr(block_cache, "MIN_BYTES", 0)
    return directory


@pytest.fixture
def small(tmp_path):
    return write_gguf(tmp_path / "q41.gguf", hf_llama(QUANT, tie=True, seed=3), Q.Q4_1)


def _no_repack(monkeypatch):
    """Fail the test if the load repacks instead of mapping the entry."""

    def fail(*args, **kwargs):
        raise AssertionError("the load repacked the matrices instead of reading the cache")

    monkeypatch.setattr("oneblock.io.gguf.load.block_modules", fail)


def _block_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: m.blocks for name, m in model.named_modules() if isinstance(m, (BlockLinear, BlockEmbedding))}


def _assert_same_model(a: torch.nn.Module, b: torch.nn.Module, prompt: torch.Tensor) -> None:
    blocks_a, blocks_b = _block_buffers(a), _block_buffers(b)
    assert blocks_a.keys() == blocks_b.keys() and blocks_a
    for name in blocks_a:
        assert torch.equal(blocks_a[name], blocks_b[name]), name
    fmts = {n: m.fmt for n, m in a.named_modules() if isinstance(m, (BlockLinear, BlockEmbedding))}
    assert fmts == {n: m.fmt for n, m in b.named_modules() if isinstance(m, (BlockLinear, BlockEmbedding))}
    with torch.no_grad():
        assert torch.equal(a(prompt), b(prompt))  # bit for bit


def _entry(directory):
    (entry,) = directory.glob("*.blocks")
    return entry


def test_a_cached_load_is_the_repacked_model_bit_for_bit_on_smollm2(cache_dir, monkeypatch):
    from oneblock.inference.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    before = path.stat()
    repacked = from_gguf(path, cache=False)
    assert not cache_dir.exists()  # cache=False writes nothing
    first = from_gguf(path)  # repacks and writes the entry
    entry = _entry(cache_dir)
    _no_repack(monkeypatch)
    cached = from_gguf(path)
    prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314, 9745, 30, 378]])
    _assert_same_model(repacked, first, prompt)
    _assert_same_model(repacked, cached, prompt)
    assert cached.lm_head.blocks.data_ptr() == cached.embed.tok.blocks.data_ptr()  # the tied matrix, once
    assert sum(t.numel() for t in {t.data_ptr(): t for t in _block_buffers(cached).values()}.values()) > 90e6
    assert entry.stat().st_size > 90e6
    after = path.stat()  # the GGUF file is only read
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def test_generation_from_a_cached_load_equals_the_repacked_one(cache_dir, small):
    from oneblock.inference.generation import generate

    repacked = from_gguf(small, cache=False)
    from_gguf(small)
    cached = from_gguf(small)
    prompt = ids(1, 7, 211, seed=4)
    a = generate(repacked, prompt, 8, greedy=True, return_logits=True)
    b = generate(cached, prompt, 8, greedy=True, return_logits=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _vm_flags(path) -> list[list[str]]:
    """The VmFlags of each mapping of ``path`` in this process (/proc/self/smaps)."""
    flags, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                current = line.split(maxsplit=5)[-1].strip()
            elif line.startswith("VmFlags:") and current == str(path):
                flags.append(line.split()[1:])
    return flags


def test_a_cached_entry_is_mapped_with_the_huge_page_advice(cache_dir, small):
    from_gguf(small)
    cached = from_gguf(small)
    entry = _entry(cache_dir)
    flags = _vm_flags(entry)
    assert flags, "the entry is not mapped"
    assert all("hg" in f for f in flags)  # MADV_HUGEPAGE: read and mapped 2 MiB at a time where the kernel can
    assert _block_buffers(cached)  # the modules are views of that mapping


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _inside_a_matrix(entry) -> int:
    """A byte in the middle of the entry's largest matrix (not in the padding between matrices)."""
    fd = os.open(entry, os.O_RDONLY)
    try:
        header, start = block_cache._read_header(fd, os.fstat(fd).st_size, "entry")
    finally:
        os.close(fd)
    record = max(header["tensors"], key=lambda r: r["rows"] * r["cols"])
    return start + record["offset"] + record["rows"] * record["cols"] // 2


@pytest.mark.parametrize(
    ("damage", "told"),
    [
        ("data", r"holds matrix \d+ with other bytes than were written \(CRC-32 mismatch\)"),
        ("last byte", r"holds matrix \d+ with other bytes than were written \(CRC-32 mismatch\)"),
        ("header", r"has a header that does not match its SHA-256"),
        ("magic", r"is not a block cache of this oneblock"),
        ("truncated", r"bytes long, not the \d+ \+ \d+ its header records"),
        ("appended", r"bytes long, not the \d+ \+ \d+ its header records"),
        ("empty", r"is shorter than its header"),
    ],
)
def test_a_damaged_entry_is_told_rebuilt_and_replaced(cache_dir, small, capfd, damage, told):
    repacked = from_gguf(small, cache=False)
    from_gguf(small)
    entry = _entry(cache_dir)
    good = entry.read_bytes()
    size = len(good)
    if damage == "data":
        _flip(entry, _inside_a_matrix(entry))
    elif damage == "last byte":
        _flip(entry, size - 1)
    elif damage == "header":
        _flip(entry, 60)
    elif damage == "magic":
        _flip(entry, 0)
    elif damage == "truncated":
        os.truncate(entry, size - 1)
    elif damage == "appended":
        with open(entry, "ab") as f:
            f.write(b"\0")
    else:
        os.truncate(entry, 0)
    capfd.readouterr()
    rebuilt = from_gguf(small)
    err = capfd.readouterr().err
    assert "oneblock: the block cache" in err and "rebuilding it" in err
    assert re.search(told, err), err
    assert entry.read_bytes() == good  # replaced by a whole new entry, the same bytes as the first
    _assert_same_model(repacked, rebuilt, ids(2, 6, 211, seed=5))
    capfd.readouterr()
    again = from_gguf(small)  # and the new entry verifies, silently
    assert capfd.readouterr().err == ""
    _assert_same_model(repacked, again, ids(1, 5, 211, seed=6))


def test_a_changed_gguf_file_makes_its_entry_stale(cache_dir, tmp_path, capfd):
    path = tmp_path / "m.gguf"
    write_gguf(path, hf_llama(QUANT, tie=True, seed=3), Q.Q4_1)
    from_gguf(path)
    entry = _entry(cache_dir)
    old = entry.read_bytes()
    write_gguf(path, hf_llama(QUANT, tie=True, seed=4), Q.Q4_1)  # same name, same size, other weights
    capfd.readouterr()
    model = from_gguf(path)
    assert capfd.readouterr().err == ""  # stale, not damaged: rebuilt without a word
    assert entry.read_bytes() != old
    _assert_same_model(from_gguf(path, cache=False), model, ids(1, 6, 211, seed=7))


def test_the_cache_can_be_turned_off(tmp_path, small, monkeypatch):
    for value in ("0", "off", "OFF", ""):
        monkeypatch.setenv(block_cache.ENV, value)
        assert block_cache.cache_directory() is None
    monkeypatch.setattr(block_cache, "MIN_BYTES", 0)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv(block_cache.ENV, "0")
    from_gguf(small)
    assert not (tmp_path / "home").exists()
    monkeypatch.delenv(block_cache.ENV)
    assert block_cache.cache_directory() == tmp_path / "home" / ".cache" / "oneblock" / "gguf"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    from_gguf(small)
    assert len(list((tmp_path / "xdg" / "oneblock" / "gguf").glob("*.blocks"))) == 1


def test_small_models_are_not_cached(tmp_path, small, monkeypatch):
    monkeypatch.setenv(block_cache.ENV, str(tmp_path / "cache"))
    from_gguf(small)  # its block matrices are far under MIN_BYTES
    assert not list((tmp_path / "cache").glob("*"))


def test_an_unwritable_cache_is_told_and_the_load_goes_on(tmp_path, small, monkeypatch, capfd):
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(block_cache.ENV, str(blocker / "cache"))
    monkeypatch.setattr(block_cache, "MIN_BYTES", 0)
    model = from_gguf(small)
    err = capfd.readouterr().err
    assert "oneblock: cannot use the block cache directory" in err and "not cached" in err
    assert blocker.read_text() == "not a directory"
    _assert_same_model(from_gguf(small, cache=False), model, ids(1, 4, 211, seed=8))


def test_a_symlink_in_place_of_an_entry_is_replaced_and_its_target_untouched(cache_dir, small, tmp_path, capfd):
    from_gguf(small)
    entry = _entry(cache_dir)
    entry.unlink()
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"the user's own file")
    entry.symlink_to(precious)
    capfd.readouterr()
    model = from_gguf(small)
    assert "rebuilding it" in capfd.readouterr().err
    assert precious.read_bytes() == b"the user's own file"
    assert entry.is_file() and not entry.is_symlink()
    _assert_same_model(from_gguf(small, cache=False), model, ids(1, 4, 211, seed=9))


def test_prune_removes_only_the_caches_orphans(cache_dir, tmp_path, small):
    other = tmp_path / "other.gguf"
    other.write_bytes(small.read_bytes())
    from_gguf(small)
    from_gguf(other)
    entries = sorted(cache_dir.glob("*.blocks"))
    assert len(entries) == 2
    foreign = cache_dir / ("0" * 24 + ".blocks")  # named like an entry, but not the cache's
    foreign.write_bytes(b"somebody else's bytes")
    note = cache_dir / "notes.txt"
    note.write_text("kept")
    stale_tmp, fresh_tmp = cache_dir / ".0123abcd.tmp", cache_dir / ".89abcdef.tmp"
    stale_tmp.write_bytes(b"x")
    fresh_tmp.write_bytes(b"y")
    os.utime(stale_tmp, (1e9, 1e9))
    digest = hashlib.sha256(small.read_bytes()).hexdigest()
    other.unlink()  # its entry is now an orphan
    removed = block_cache.prune(cache_dir)
    assert sorted(removed) == sorted([block_cache.entry_path(cache_dir, other), stale_tmp])
    assert foreign.read_bytes() == b"somebody else's bytes" and note.read_text() == "kept" and fresh_tmp.exists()
    assert block_cache.entry_path(cache_dir, small).exists()
    assert hashlib.sha256(small.read_bytes()).hexdigest() == digest


@contextlib.contextmanager
def _no_hang(seconds: int = 60):
    """Fail, instead of hanging, when a load blocks (opening a FIFO waits for a writer): SIGALRM interrupts it."""

    def expire(signum, frame):
        raise AssertionError(f"blocked for {seconds} s: a FIFO was opened")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_fifo_in_place_of_an_entry_is_told_and_the_load_goes_on_without_the_cache(cache_dir, small, capfd):
    cache_dir.mkdir()
    entry = block_cache.entry_path(cache_dir, small)
    os.mkfifo(entry)
    with _no_hang():
        model = from_gguf(small)
        again = from_gguf(small)
    err = capfd.readouterr().err
    assert err.count(f"the block cache entry '{entry}' is a FIFO (named pipe), not a regular file") == 2, err
    assert "loaded without the cache" in err
    assert entry.is_fifo() and sorted(cache_dir.iterdir()) == [entry]  # neither opened nor replaced
    _assert_same_model(from_gguf(small, cache=False), model, ids(1, 4, 211, seed=10))
    _assert_same_model(model, again, ids(1, 4, 211, seed=11))


def test_a_fifo_named_like_an_entry_does_not_stop_other_models_being_cached(cache_dir, small, capfd):
    cache_dir.mkdir()
    fifo, fifo_tmp = cache_dir / ("f" * 24 + ".blocks"), cache_dir / ".0123abcd.tmp"
    os.mkfifo(fifo)
    os.mkfifo(fifo_tmp)
    with _no_hang():
        from_gguf(small)  # the first load of a model writes its entry, then prunes the directory
        assert block_cache.prune(cache_dir) == []
    err = capfd.readouterr().err
    assert f"holds '{fifo}', which is not a regular file; left alone" in err
    assert f"holds '{fifo_tmp}', which is not a regular file; left alone" in err
    assert fifo.is_fifo() and fifo_tmp.is_fifo() and block_cache.entry_path(cache_dir, small).is_file()
