"""The Transformer example's corpus, made here rather than downloaded: seeded sentences of a tiny grammar.

Simple English sentences ("the old dog finds a red ball near the river.") and sums of small numbers
("three plus four is seven."), drawn from short word lists with a seeded generator: the same text on every
host and every run. A character-level model learns its spelling and word order quickly, then the agreement of
the sums more slowly, so the loss falls visibly for a few thousand steps. The vocabulary is the corpus's
characters (about 30).
"""

from __future__ import annotations

import numpy as np

DETERMINERS = ("the", "a", "my", "every", "that")
ADJECTIVES = ("old", "small", "red", "quiet", "happy", "green", "brave", "tired")
NOUNS = ("dog", "cat", "bird", "farmer", "child", "robot", "teacher", "ball", "boat", "garden")
VERBS = ("sees", "finds", "likes", "follows", "paints", "carries", "watches", "builds")
PLACES = ("near the river", "in the house", "at the market", "under the tree", "on the hill", "by the sea")
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def corpus_text(characters: int = 200_000, seed: int = 0) -> str:
    """At least `characters` characters of sentences separated by spaces, the same for the same arguments.

    Every random choice of a batch of sentences is drawn at once (a choice per sentence and slot): a
    generator call per word would take a second for the default length, on every rank's start."""
    rng = np.random.default_rng(seed)
    sentences: list[str] = []
    length = 0
    while length < characters:
        kind, adjective1, adjective2, place = rng.random((4, 1024))
        d1, d2, a1, a2, n1, n2, verb, where = (rng.integers(0, len(words), 1024) for words in (
            DETERMINERS, DETERMINERS, ADJECTIVES, ADJECTIVES, NOUNS, NOUNS, VERBS, PLACES))
        x, y = rng.integers(0, 6, (2, 1024))
        for i in range(1024):
            if kind[i] < 0.25:
                sentence = f"{NUMBERS[x[i]]} plus {NUMBERS[y[i]]} is {NUMBERS[x[i] + y[i]]}."
            else:
                subject = " ".join([DETERMINERS[d1[i]], *([ADJECTIVES[a1[i]]] if adjective1[i] < 0.5 else []),
                                    NOUNS[n1[i]]])
                obj = " ".join([DETERMINERS[d2[i]], *([ADJECTIVES[a2[i]]] if adjective2[i] < 0.5 else []),
                                NOUNS[n2[i]]])
                sentence = f"{subject} {VERBS[verb[i]]} {obj}{' ' + PLACES[where[i]] if place[i] < 0.5 else ''}."
            sentences.append(sentence)
            length += len(sentence) + 1
            if length >= characters:
                break
    return " ".join(sentences)


def vocabulary(text: str) -> str:
    """The characters of `text`, sorted: character i has token id i."""
    return "".join(sorted(set(text)))


def encode(text: str, vocab: str) -> np.ndarray:
    """`text` as token ids (int32)."""
    index = {char: i for i, char in enumerate(vocab)}
    return np.fromiter((index[char] for char in text), dtype=np.int32, count=len(text))
