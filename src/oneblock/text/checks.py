"""Text at the boundaries: what a user types, pipes or sends must be valid Unicode before it is tokenized.

Python represents bytes that are not UTF-8 in ``sys.argv`` (and in stdin under a C locale) as lone surrogates
U+DC80..U+DCFF ("surrogateescape"), and JSON's ``"\\ud800"`` escape makes a lone surrogate too. Neither can be
encoded to UTF-8, so every tokenizer fails on them deep inside. oneblock refuses them where text comes in, with
an ``InputError`` that names the offset, rather than guessing a replacement the user did not write.
"""

from __future__ import annotations

import re

from oneblock.errors import InputError

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, what: str = "the text") -> str:
    """``text`` itself, if it is valid Unicode (no lone surrogates).

    Raises:
        InputError: naming the first bad character's offset, and the byte for one that came from undecodable
            input (``"caf\\xff"`` in a command line).
    """
    found = _SURROGATE.search(text)
    if found is None:
        return text
    point, at = ord(found.group()), found.start()
    if 0xDC80 <= point <= 0xDCFF:  # surrogateescape: an undecodable byte of the original input
        raise InputError(
            f"{what} is not valid UTF-8: byte {point - 0xDC00:#04x} at character offset {at}; "
            "save or type the text as UTF-8"
        )
    raise InputError(
        f"{what} holds a lone surrogate U+{point:04X} at character offset {at}, which is not valid Unicode; "
        "send complete surrogate pairs or the character itself"
    )


def decode_utf8(data: bytes, what: str = "the input") -> str:
    """``data`` decoded as UTF-8 (a leading byte-order mark dropped).

    Raises:
        InputError: naming the byte offset of the first invalid byte.
    """
    start = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    try:
        return check_text(data[start:].decode("utf-8"), what)
    except UnicodeDecodeError as error:
        at = start + error.start
        raise InputError(
            f"{what} is not valid UTF-8: byte {data[at]:#04x} at byte offset {at}; convert it to UTF-8 (iconv -t UTF-8)"
        ) from None
