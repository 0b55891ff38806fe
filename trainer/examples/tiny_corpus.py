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


def _noun_phrase(rng: np.random.Generator) -> str:
    words = [str(rng.choice(DETERMINERS))]
    if rng.random() < 0.5:
        words.append(str(rng.choice(ADJECTIVES)))
    words.append(str(rng.choice(NOUNS)))
    return " ".join(words)


def _sentence(rng: np.random.Generator) -> str:
    if rng.random() < 0.25:
        a, b = (int(n) for n in rng.integers(0, 6, size=2))
        return f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
    place = f" {rng.choice(PLACES)}" if rng.random() < 0.5 else ""
    return f"{_noun_phrase(rng)} {rng.choice(VERBS)} {_noun_phrase(rng)}{place}."


def corpus_text(characters: int = 200_000, seed: int = 0) -> str:
    """At least `characters` characters of sentences separated by spaces, the same for the same arguments."""
    rng = np.random.default_rng(seed)
    sentences: list[str] = []
    length = 0
    while length < characters:
        sentences.append(_sentence(rng))
        length += len(sentences[-1]) + 1
    return " ".join(sentences)


def vocabulary(text: str) -> str:
    """The characters of `text`, sorted: character i has token id i."""
    return "".join(sorted(set(text)))


def encode(text: str, vocab: str) -> np.ndarray:
    """`text` as token ids (int32)."""
    index = {char: i for i, char in enumerate(vocab)}
    return np.fromiter((index[char] for char in text), dtype=np.int32, count=len(text))
