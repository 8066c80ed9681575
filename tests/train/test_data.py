"""Byte-level text data: reading, splitting, and windows whose stream can be saved and resumed."""

from __future__ import annotations

import itertools

import pytest
import torch

from oneblock.errors import CheckpointError, InputError
from oneblock.train import data


def test_bytes_round_trip_any_utf8():
    text = "naïve café — 東京 🚀"
    ids = data.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < data.BYTE_VOCAB
    assert len(ids) == len(text.encode("utf-8"))
    assert data.decode(ids) == text
    assert data.decode([0xE6, 0x9D]) == "\ufffd"  # a torn multi-byte character decodes, visibly


def test_default_corpus_ships_with_the_package():
    corpus = data.read_text(None)
    assert len(corpus) > 10_000
    corpus.decode("utf-8")


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "does not exist"), (b"", "is empty"), (b"ok \xff\xfe bad", r"not UTF-8 \(byte 3 is 0xff\)")],
)
def test_read_text_refuses_bad_files(tmp_path, content, match):
    path = tmp_path / "t.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError, match=match):
        data.read_text(path)


def test_split_keeps_a_held_out_tail():
    ids = torch.arange(100)
    train, held_out = data.split(ids, 0.1, window=5)
    assert torch.equal(torch.cat([train, held_out]), ids) and len(held_out) == 10
    _, small = data.split(ids, 0.01, window=5)
    assert len(small) == 5  # at least one window
    with pytest.raises(InputError, match="too short for windows of 60 bytes"):
        data.split(ids, 0.5, window=60)


def test_windows_cover_an_epoch_without_overlap_and_resume_exactly():
    ids = torch.arange(50)
    windows = data.TextWindows(ids, 7, seed=3)
    epoch = windows.next(len(windows._starts))  # (W, 7)
    starts = sorted(epoch[:, 0].tolist())
    assert all(b - a >= 7 for a, b in itertools.pairwise(starts))
    assert all(torch.equal(row, torch.arange(row[0], row[0] + 7)) for row in epoch)
    state = windows.state_dict()
    ahead = windows.next(9)  # crosses into the next epoch
    fresh = data.TextWindows(ids, 7, seed=3)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.next(9), ahead)
    assert not torch.equal(data.TextWindows(ids, 7, seed=4).next(5), data.TextWindows(ids, 7, seed=3).next(5))


def test_eval_windows_are_fixed_and_inside_the_text():
    ids = torch.arange(40)
    a = data.eval_windows(ids, 9, max_windows=4)
    assert a.shape == (4, 9) and torch.equal(a, data.eval_windows(ids, 9, max_windows=4))
    assert int(a[0, 0]) == 0 and int(a[-1, -1]) == 39


def test_a_position_that_does_not_fit_the_text_is_refused():
    """A position saved for a longer text (the file shrank) is refused, never an IndexError at the next batch."""
    long, short = data.TextWindows(torch.arange(700) % 256, 7, seed=3), data.TextWindows(torch.arange(70), 7, seed=3)
    long.next(50)
    with pytest.raises(CheckpointError, match=r"position \(epoch 0, window 50\) does not fit this text of 70 ids"):
        short.load_state_dict(long.state_dict())
    with pytest.raises(CheckpointError, match=r"position \(epoch -1, window 0\)"):
        short.load_state_dict({"epoch": -1, "cursor": 0})
    short.load_state_dict({"epoch": 2, "cursor": 3})
    assert short.state_dict() == {"epoch": 2, "cursor": 3}
