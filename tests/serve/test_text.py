"""Stop strings are matched on the decoded text, across token boundaries, and never handed out.

Reference: the whole decoded text cut at the first occurrence of any stop string (Python's ``str.find``).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from oneblock.serve.text import StopText
from oneblock.text.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


def run(ids: list[int], stop: list[str]) -> tuple[str, bool, int]:
    """Push every id until a stop; return the text handed out, whether it stopped, and the ids consumed."""
    text = StopText(TOKENIZER, stop)
    out, used = [], 0
    for token in ids:
        used += 1
        out.append(text.push(token))
        if text.stopped:
            break
    out.append(text.finish())
    return "".join(out), text.stopped, used


def expected(ids: list[int], stop: list[str]) -> str:
    full = TOKENIZER.decode(ids)
    cuts = [i for i in (full.find(s) for s in stop) if i >= 0]
    return full[: min(cuts)] if cuts else full


def test_a_stop_string_spread_over_tokens_is_cut_and_held_back():
    text = StopText(TOKENIZER, ["END"])
    assert [text.push(t) for t in b"abcE"] == ["a", "b", "c", ""]  # "E" may begin "END": held
    assert text.push(ord("N")) == "" and not text.stopped
    assert text.push(ord("D")) == "" and text.stopped
    assert text.finish() == ""


def test_a_false_start_is_released_and_a_split_character_waits():
    text = StopText(TOKENIZER, ["EX"])
    assert text.push(ord("E")) == ""
    assert text.push(ord("Y")) == "EY"  # not "EX" after all
    assert text.push(0xC3) == "" and text.push(0xA9) == "é"  # one character in two tokens


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.sampled_from([*b"abAB \n", 0xC3, 0xA9]), max_size=40),
    stop=st.lists(st.text(alphabet="abAB \né", min_size=1, max_size=4), max_size=4),
)
def test_the_text_handed_out_is_the_full_text_cut_at_the_first_stop(ids, stop):
    got, stopped, used = run(ids, stop)
    assert got == expected(ids, stop)
    if stopped:  # it stopped at the first token whose text completes a stop string
        assert any(s in TOKENIZER.decode(ids[:used]) for s in stop)
        assert not any(s in TOKENIZER.decode(ids[: used - 1]) for s in stop)
