"""The argv words both sides read: which first word names a python, and the agents' prefix rule."""

from __future__ import annotations

import pytest

from proto.vocabulary import PYTHON_WORD, names_a_python, starts_with_one_of, with_python


@pytest.mark.parametrize("word", ["python", "python3", "python3.11", "/usr/bin/python3", "venv/bin/python"])
def test_words_that_name_a_python(word: str) -> None:
    assert names_a_python(word)
    assert with_python([word, "train.py", "--epochs", "3"]) == [PYTHON_WORD, "train.py", "--epochs", "3"]


@pytest.mark.parametrize("word", ["ipython", "pythonic", "python-config", "python3-train", "train.py", PYTHON_WORD])
def test_words_that_do_not(word: str) -> None:
    assert not names_a_python(word)
    assert with_python([word, "x"]) == [word, "x"]


def test_an_argv_is_allowed_only_by_a_whole_word_prefix() -> None:
    prefixes = [[PYTHON_WORD, "train.py"], ["/opt/job/run"]]
    assert starts_with_one_of([PYTHON_WORD, "train.py", "--lr", "1"], prefixes)
    assert starts_with_one_of(["/opt/job/run"], prefixes)
    assert not starts_with_one_of([PYTHON_WORD, "train.py.bak"], prefixes)  # words, not characters
    assert not starts_with_one_of([PYTHON_WORD], prefixes)  # shorter than every prefix
    assert not starts_with_one_of([], prefixes)
    assert not starts_with_one_of([PYTHON_WORD, "train.py"], [])
