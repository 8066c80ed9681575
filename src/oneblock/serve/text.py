"""Generated ids to text, as a stream, stopping at stop strings that may span several tokens.

A stop string is matched on the decoded text, not on ids: ``"\\n\\n"`` may arrive as one token or as two. Text
that could still become the start of a stop string is held back until the next token decides; the stop string
itself is never returned.
"""

from __future__ import annotations

from collections.abc import Sequence

from oneblock.text.tokenizer import TextStream, Tokenizer


class StopText:
    """Push ids one at a time; get the text that is safe to hand out, and whether a stop string was reached.

    Args:
        tokenizer: decodes the ids (whole characters only: see ``TextStream``).
        stop: the stop strings (non-empty); an empty sequence stops nowhere.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.stream = TextStream(tokenizer)
        self.stop = tuple(stop)
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of ``text`` handed out
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one id; return the new text that can be handed out ('' while a stop string may be starting)."""
        self.text += self.stream.push([token])
        if not self.stop:
            return self._release(len(self.text))
        longest = max(len(s) for s in self.stop)
        start = max(0, self.sent - longest + 1)  # a match may begin in text already sent, end in the new text
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.stopped = True
            return self._release(min(found))
        return self._release(len(self.text) - self._held())

    def finish(self) -> str:
        """The rest of the text, once generation has ended without a stop string."""
        if self.stopped:
            return ""
        self.text += self.stream.flush()
        return self._release(len(self.text))

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string (held back until the next token)."""
        for n in range(min(len(self.text) - self.sent, max(len(s) for s in self.stop) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _release(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out
