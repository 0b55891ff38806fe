"""While a rank trains under TrainerdCallback, every `Model.eval` of its process tells the agent it evaluates.

An evaluation reports no step, so one longer than the job's `hang_timeout_s` would be taken for a hang,
and, since it comes back at the same point after a restart, would end every generation there. `Model.fit`'s
evaluations call the training's callbacks (TrainerdCallback hears `on_eval_begin`/`on_eval_step_end`), but
an evaluation that a script's own callback runs gets only the callbacks it is given: ModelZoo's
`EvalCallBack` calls `model.eval(dataset)` in `epoch_end`. For as long as the training runs, `Model.eval`
therefore adds a callback of its own that passes each evaluation step on: a sign of life for as long as
batches are evaluated, and none once the evaluation itself hangs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from mindspore.train import Callback, Model, RunContext

Tell = Callable[[bool], None]  # tell(first): an evaluation began (True) or went on a step (False)


class EvaluationWatch(Callback):
    """Passes `Model.eval`'s progress to `tell`."""

    def __init__(self, tell: Tell) -> None:
        super().__init__()
        self._tell = tell

    def on_eval_begin(self, run_context: RunContext) -> None:
        self._tell(True)

    def on_eval_step_end(self, run_context: RunContext) -> None:
        self._tell(False)


def watch_model_eval(tell: Tell) -> Callable[[], None]:
    """Make every `Model.eval` call in this process tell `tell`; returns what undoes it. A second watch
    while one is on replaces nothing (one rank trains once at a time) and undoes nothing."""
    original = Model.eval
    if getattr(original, "_trainerd_watch", False):
        return lambda: None
    watch = EvaluationWatch(tell)

    @functools.wraps(original)
    def eval_watched(model: Model, valid_dataset: Any, callbacks: Any = None, dataset_sink_mode: bool = False) -> Any:
        return original(model, valid_dataset, callbacks=_with(callbacks, watch), dataset_sink_mode=dataset_sink_mode)

    eval_watched._trainerd_watch = True  # type: ignore[attr-defined]
    Model.eval = eval_watched  # type: ignore[method-assign]

    def undo() -> None:
        if Model.eval is eval_watched:
            Model.eval = original  # type: ignore[method-assign]
    return undo


def _with(callbacks: Any, watch: Callback) -> list[Callback]:
    """`Model.eval`'s callbacks argument (None, one callback or a list of them) with `watch` added."""
    if callbacks is None:
        return [watch]
    if isinstance(callbacks, Callback):
        return [callbacks, watch]
    return [*callbacks, watch]
