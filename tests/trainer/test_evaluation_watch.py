"""The Model.eval watch TrainerdCallback puts on while a rank trains: on, once, and off again."""

from __future__ import annotations

from mindspore.train import Callback, Model

from trainer.runtime.evaluation_watch import EvaluationWatch, _with, watch_model_eval


def test_the_watch_is_added_to_whatever_callbacks_model_eval_is_given() -> None:
    watch, own = EvaluationWatch(lambda first: None), Callback()
    assert _with(None, watch) == [watch]
    assert _with(own, watch) == [own, watch]
    assert _with([own], watch) == [own, watch] and _with((own,), watch) == [own, watch]


def test_model_eval_is_watched_once_and_given_back_as_it_was() -> None:
    original = Model.eval
    undo = watch_model_eval(lambda first: None)
    try:
        assert Model.eval is not original and Model.eval.__name__ == "eval"
        watched = Model.eval
        second = watch_model_eval(lambda first: None)
        assert Model.eval is watched  # not wrapped twice
        second()
        assert Model.eval is watched  # and the second's undo leaves the first watch on
    finally:
        undo()
    assert Model.eval is original
    undo()  # twice is harmless
    assert Model.eval is original
