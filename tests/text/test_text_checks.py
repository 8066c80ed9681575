"""Text at the boundaries: lone surrogates and bytes that are not UTF-8 are one InputError naming the offset."""

from __future__ import annotations

import pytest

from oneblock.errors import InputError
from oneblock.text.checks import check_text, decode_utf8
from oneblock.text.tokenizer import ByteTokenizer


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("\ud800", r"the text holds a lone surrogate U\+D800 at character offset 0"),
        ("ab\udfffc", r"lone surrogate U\+DFFF at character offset 2"),
        ("caf\udcff", "the text is not valid UTF-8: byte 0xff at character offset 3"),
        ("\U0001f642\udc80", "byte 0x80 at character offset 1"),
    ],
)
def test_lone_surrogates_are_refused_with_the_offset(text, match):
    with pytest.raises(InputError, match=match):
        check_text(text)


def test_valid_text_passes_unchanged():
    text = "caf\u00e9 \U0001f642 \u20ac"
    assert check_text(text) is text
    assert decode_utf8(text.encode()) == text
    assert decode_utf8(b"\xef\xbb\xbfhi") == "hi"  # a byte-order mark is not text


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"hi \xff", "the input is not valid UTF-8: byte 0xff at byte offset 3"),
        (b"\xc3(", "byte 0xc3 at byte offset 0"),
        ("\ud800".encode("utf-8", "surrogatepass"), "byte 0xed at byte offset 0"),
    ],
)
def test_bytes_that_are_not_utf8(data, match):
    with pytest.raises(InputError, match=match):
        decode_utf8(data)


def test_tokenizers_refuse_instead_of_failing_inside():
    with pytest.raises(InputError, match=r"lone surrogate U\+D83D at character offset 1"):
        ByteTokenizer().encode("a\ud83d")
