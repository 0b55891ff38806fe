"""The Transformer example's corpus: the same text on every host and run, sums that are right, and a
vocabulary that encodes all of it."""

from __future__ import annotations

import re

from trainer.examples.tiny_corpus import NUMBERS, corpus_text, encode, vocabulary


def test_the_corpus_is_the_same_for_the_same_seed_and_differs_for_another() -> None:
    assert corpus_text(5000) == corpus_text(5000)
    assert corpus_text(5000, seed=1) != corpus_text(5000)
    assert len(corpus_text(5000)) >= 5000


def test_every_sum_in_the_corpus_is_right() -> None:
    sums = re.findall(r"(\w+) plus (\w+) is (\w+)\.", corpus_text(20_000))
    assert len(sums) > 100
    assert all(NUMBERS.index(a) + NUMBERS.index(b) == NUMBERS.index(total) for a, b, total in sums)


def test_the_vocabulary_encodes_the_whole_text() -> None:
    text = corpus_text(20_000)
    vocab = vocabulary(text)
    tokens = encode(text, vocab)
    assert len(vocab) < 40 and "".join(vocab[t] for t in tokens) == text
