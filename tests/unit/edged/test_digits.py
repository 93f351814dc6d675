"""``edged.common.digits.whole``: the one way text from outside becomes a whole number."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from edged.common.digits import whole


def test_ascii_digits_only_and_few() -> None:
    assert whole("0") == 0 and whole("0042") == 42 and whole("9" * 18) == 10**18 - 1
    assert whole("9" * 19) is None and whole("123", 2) is None and whole("12", 2) == 12
    # each of these str.isdigit takes or int() would parse: not a whole number here
    for text in ("", None, "\u00b2", "\u0661", "\uff11", " 1", "1 ", "+1", "-1", "1_000", "1.0"):
        assert whole(text) is None, repr(text)


@given(st.text(max_size=30))
def test_any_text_is_a_number_or_none_never_an_exception(text: str) -> None:
    value = whole(text)
    if value is None:
        assert not (text and len(text) <= 18 and all("0" <= c <= "9" for c in text))
    else:
        assert str(value) == text.lstrip("0") or (value == 0 and set(text) == {"0"})
