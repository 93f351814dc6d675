"""Whole numbers from text a caller, a peer or a header gave: ASCII digits only, and few.

``str.isdigit`` takes ``'²'`` and every other Unicode digit, which ``int`` then refuses
(ValueError: a 500 where a 400 was due), and any count of digits, which ``int`` refuses past
4,300 (CPython's limit) after spending time on them."""

from __future__ import annotations


def whole(text: str | None, max_digits: int = 18) -> int | None:
    """``text`` as an int when it is 1 to ``max_digits`` ASCII digits, else None."""
    if text and len(text) <= max_digits and text.isascii() and text.isdigit():
        return int(text)
    return None
