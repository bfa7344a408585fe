"""A request's output text as its tokens arrive: the text decoded so far, the part safe to send (not
ending in a partial character, not possibly the start of a stop string), and where a stop string ends it."""

from __future__ import annotations

from typing import Any


class OutputText:
    """Text of generated ids fed one at a time (`add`); `stop` strings end it before their first match.

    `add` returns the new text that may be sent now: text is held back while it ends in a partial
    UTF-8 character or could be the start of a stop string. `finish` returns what is left to send.
    The pieces joined are always `text`, the final answer."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string matched
        self._sent = 0  # characters of `text` already returned

    def add(self, tok: int) -> str:
        """Take the next id; returns the text that can be sent now ("" while held back or after a stop)."""
        if self.stopped:
            return ""
        self.ids.append(int(tok))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a partial character: wait for its other bytes
            return ""
        # a match must end in the new text: search from where it could start
        found = [at for s in self.stop if (at := text.find(s, max(0, len(self.text) - len(s) + 1))) >= 0]
        if found:
            text, self.stopped = text[: min(found)], True
        hold = 0 if self.stopped else max((_overlap(text, s) for s in self.stop), default=0)
        self.text = text
        return self._take(len(text) - hold)

    def finish(self) -> str:
        """The text still held back (sent once the answer has ended)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece = self.text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return piece


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper start of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
