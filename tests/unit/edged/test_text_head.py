"""Issue 44, point 6: a text is tokenized from its head (``TextEmbedding.head``), so a long
text costs what its first MAX_TOKENS tokens cost; those tokens must be the whole text's own."""

from __future__ import annotations

import random
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from edged.pipelines.text import HEAD_CHARS, MAX_TOKENS, TextEmbedding
from tests.conftest import MODELS


@pytest.fixture(scope="module")
def embedding() -> TextEmbedding:
    made = TextEmbedding.__new__(TextEmbedding)  # the tokenizer only: no model, no steps
    made.tokenizer = Tokenizer.from_file(str(MODELS / "text-embedding" / "1" / "tokenizer.json"))
    made.tokenizer.enable_truncation(MAX_TOKENS)
    return made


def first_tokens(embedding: TextEmbedding, text: str) -> list[int]:
    return list(embedding.tokenizer.encode(text).ids)


WORDS = st.text(alphabet=string.ascii_letters + "éß漢字0123456789.,!?'-", min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(st.lists(WORDS, min_size=1, max_size=3000), st.sampled_from([" ", "  ", "\n", " \t"]))
def test_the_head_holds_the_texts_first_tokens(
    embedding: TextEmbedding, words: list[str], gap: str
) -> None:
    text = gap.join(words)
    head = embedding.head(text)
    assert text.startswith(head)
    assert first_tokens(embedding, head) == first_tokens(embedding, text)


def test_a_long_text_is_cut_and_a_text_of_long_words_is_read_further(
    embedding: TextEmbedding,
) -> None:
    rng = random.Random(7)
    prose = " ".join(
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(4000)
    )
    assert len(embedding.head(prose)) <= HEAD_CHARS
    long_words = " ".join("x" * 101 for _ in range(400))  # over 100 characters: one [UNK]
    head = embedding.head(long_words)
    assert HEAD_CHARS < len(head) < len(long_words)
    assert first_tokens(embedding, head) == first_tokens(embedding, long_words)
    unbroken = "y" * 100_000  # no space to cut at
    assert first_tokens(embedding, embedding.head(unbroken)) == first_tokens(embedding, unbroken)
