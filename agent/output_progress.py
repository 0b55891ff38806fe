"""Training progress read from what an unmodified MindSpore script prints.

A script written for msrun reports nothing to trainerd; its progress is in its output. The parser
is fed the bytes of one rank's stdout+stderr as they arrive and returns what they say:

- MindSpore's `LossMonitor` (mindspore/train/callback/_loss_monitor.py, 2.10):
  `epoch: E step: S, loss is L`, S counting within the epoch. L is `%s` of the loss after
  `_handle_loss`: a float (`0.6931471824645996`) for a tensor output, else the first tensor of a
  tuple output (`0.7690566`, `[1.4950818]`), else the object itself, e.g.
  `(Tensor(shape=[], dtype=Float32, value= 0.693),)`. The official msrun samples print
  `epoch: E, step: S, loss is L` from their own loops (both counted from 0): recognised too. Both
  must start the line, so LossMonitor's own error on a NaN loss ("ValueError: In epoch: 1 step: 2,
  loss is NAN or INF, …") is not taken for a step.
- MindSpore's `TimeMonitor` (_time_monitor.py): `Train epoch time: X ms, per step time: Y ms`,
  optionally followed by ` (data time: Z ms)`, once per epoch (its `Eval epoch time` lines, printed
  by `Model.fit` after an evaluation, are not training and are ignored); and the per-step
  `Train per step time: Y ms mfu:…` of `FlopsUtilizationCollector`. Neither names a step: the
  step time is reported against the last step seen, and dropped before any step was seen.
- A job's `progress_pattern` (validated by `proto.progress_pattern`), which replaces the two loss formats
  above; step-time lines are still recognised.

The global step. The step printed by LossMonitor restarts every epoch, so the parser derives one
that only grows, for hang detection and status:

    global step = (epoch − first epoch) × steps per epoch + step

The first epoch is 0 when the run printed an epoch 0 first (the official samples count from 0), else 1.
Steps per epoch is learnt whenever the epoch changes: the largest step seen so far in any epoch,
plus one when steps are counted from 0 (a step 0 was seen). Until the first epoch change it is
unknown and the global step is the printed step. This is the true global step when every step is
printed, from the run's second epoch on; when only every n-th step is printed it is an estimate that
may lag but never decreases. A resumed run (its first epoch printed is past the first) thus counts
its first epoch's steps from 1, then jumps to the true count (a script that resumed from its own
checkpoint at epoch 16 of 20 steps shows step 321 in its second epoch, not 21), unless the parser is
given the `EpochShape` an earlier run of the same command at the same world size learnt (the agent
keeps it across generations, agent/epoch_shapes.py): then the count is true from the first line. A pattern with a
`global_step` group gives it directly; one with `step` but no `epoch` takes the step as global.

When the position goes backwards (the epoch or the step within the same epoch decreases, or a
global step decreases: a second `Model.train` in the same process, a rollback), counting carries
on from the last global step: the first observation after it is last + 1, and later ones follow
the new sequence from there. So the global step never decreases and, between two observations,
grows by (about) the steps trained.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Longer lines are cut: the rest of the line is dropped, not buffered.
MAX_LINE_BYTES = 8192

_LINE_END = re.compile(rb"[\r\n]")
_NUMBER = r"[-+]?(?:nan|inf(?:inity)?|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)"
_NUMBER_AT_START = re.compile(r"(?>" + _NUMBER + r")(?!\w)", re.IGNORECASE)
_NUMBERS = re.compile(r"(?<![\w.])(?>" + _NUMBER + r")(?![\w.])", re.IGNORECASE)
_LOSS_LINE = re.compile(r"^\s*epoch: (?P<epoch>\d+),? step: (?P<step>\d+), loss is (?P<loss>.*)")
_MS = r"(?P<step_time_ms>\d+(?:\.\d+)?) ms"
_STEP_TIME_LINES = (
    re.compile(r"^\s*(?:Train )?epoch time: \d+(?:\.\d+)? ms, per step time: " + _MS),
    re.compile(r"^\s*(?:Train )?per step time: " + _MS),
)


@dataclass(frozen=True)
class OutputProgress:
    """What one output line says about training.

    `step` is the derived global step (see the module docstring); `epoch` and `epoch_step` are as
    printed. `loss` may be NaN or infinite: it is reported, not refused.
    """

    step: int
    epoch: int | None = None
    epoch_step: int | None = None
    loss: float | None = None
    step_time_ms: float | None = None
    samples_per_s: float | None = None


def parse_loss(text: str) -> float | None:
    """The loss in a printed value: a number, an array (its mean, as LossMonitor takes a tensor's),
    a tensor repr (its `value=`), or a tuple of those (its first element). None when unreadable,
    e.g. an array whose rows continue on the next lines."""
    value = text.split("value=", 1)[1] if "value=" in text else text
    value = value.lstrip(" (")
    if value.startswith("["):
        depth = 0
        for end, char in enumerate(value):
            depth += {"[": 1, "]": -1}.get(char, 0)
            if depth == 0:
                numbers = [float(number) for number in _NUMBERS.findall(value[:end])]
                return sum(numbers) / len(numbers) if numbers else None
        return None
    match = _NUMBER_AT_START.match(value)
    return float(match.group()) if match else None


@dataclass(frozen=True)
class EpochShape:
    """How a run numbers its epochs and how many steps each has (module docstring, the global step)."""

    first_epoch: int  # 0 or 1
    steps_per_epoch: int
    zero_based: bool  # steps are counted from 0 within an epoch


class _GlobalStep:
    """Derives the never-decreasing global step from printed positions (module docstring)."""

    def __init__(self, shape: EpochShape | None = None) -> None:
        self._given = shape  # applies to the first epoch printed; a restart of the counting forgets it
        self.last: int | None = None
        self._base = 0  # global step = base + position − origin
        self._origin = 0
        self._last_position: int | None = None
        self._epoch: int | None = None
        self._first_epoch = 0
        self._epoch_largest = 0  # largest step seen in the current epoch
        self._largest = 0  # largest step seen in any epoch since counting (re)started
        self._zero_based = False
        self._steps_per_epoch: int | None = None

    def count_global(self, position: int) -> int:
        """A step that does not restart per epoch."""
        restarted = self._last_position is not None and position < self._last_position
        return self._advance(position, restarted)

    def count_in_epoch(self, epoch: int, step: int) -> int:
        """A step counted within its epoch."""
        restarted = self._epoch is not None and (
            epoch < self._epoch or (epoch == self._epoch and step < self._epoch_largest))
        if self._epoch is None and self._given is not None and epoch >= self._given.first_epoch:
            self._first_epoch, self._steps_per_epoch = self._given.first_epoch, self._given.steps_per_epoch
            self._epoch_largest, self._largest = step, step
            self._zero_based = self._given.zero_based
        elif self._epoch is None or restarted:
            self._first_epoch = min(epoch, 1)
            self._epoch_largest, self._largest = step, step
            self._zero_based, self._steps_per_epoch = False, None
        elif epoch > self._epoch:
            self._steps_per_epoch = self._largest + (1 if self._zero_based else 0)
            self._epoch_largest = step
        self._epoch = epoch
        self._epoch_largest = max(self._epoch_largest, step)
        self._largest = max(self._largest, step)
        self._zero_based = self._zero_based or step == 0
        if self._steps_per_epoch is None:
            return self._advance(step, restarted)
        return self._advance((epoch - self._first_epoch) * self._steps_per_epoch + step, restarted)

    @property
    def shape(self) -> EpochShape | None:
        """What this run's printed epochs showed so far; None before its first epoch change."""
        if self._steps_per_epoch is None:
            return None
        return EpochShape(self._first_epoch, self._steps_per_epoch, self._zero_based)

    def _advance(self, position: int, restarted: bool) -> int:
        # A given shape that was wrong (the data changed, the command did not) is learnt again at the next
        # epoch change, which may put the position back: counting carries on from the last step then.
        restarted = restarted or (self._last_position is not None and position < self._last_position)
        if restarted and self.last is not None:
            self._base, self._origin = self.last, position - 1
        self._last_position = position
        self.last = self._base + position - self._origin
        return self.last


class OutputProgressParser:
    """Turns one rank's output, fed in chunks of any size, into progress observations.

    Lines end at \\n or \\r; a line longer than MAX_LINE_BYTES is cut there; bytes that are not
    UTF-8 are replaced. Any split of the same bytes gives the same observations.
    """

    def __init__(self, progress_pattern: re.Pattern[str] | None = None, shape: EpochShape | None = None) -> None:
        """`shape`: how an earlier run of the same command at the same world size numbered its epochs."""
        self._pattern = progress_pattern
        self._line = bytearray()
        self._global = _GlobalStep(shape)
        self._epoch: int | None = None
        self._epoch_step: int | None = None

    def feed(self, data: bytes) -> list[OutputProgress]:
        pieces = _LINE_END.split(data)
        observations: list[OutputProgress] = []
        for piece in pieces[:-1]:
            self._keep(piece)
            observations.extend(self._end_line())
        self._keep(pieces[-1])
        return observations

    def close(self) -> list[OutputProgress]:
        """The observation of a last line that ended without a newline (the process exited)."""
        return self._end_line()

    @property
    def epoch_shape(self) -> EpochShape | None:
        return self._global.shape

    def _keep(self, piece: bytes) -> None:
        room = MAX_LINE_BYTES - len(self._line)
        if room > 0:
            self._line += piece[:room]

    def _end_line(self) -> list[OutputProgress]:
        line = self._line.decode("utf-8", errors="replace")
        self._line.clear()
        observation = self._observe(line) if line.strip() else None
        return [] if observation is None else [observation]

    def _observe(self, line: str) -> OutputProgress | None:
        match = self._pattern.search(line) if self._pattern is not None else _LOSS_LINE.search(line)
        if match is not None:
            return self._step_line(match.groupdict())
        for step_time_line in _STEP_TIME_LINES:
            timed = step_time_line.search(line)
            if timed is not None:
                if self._global.last is None:
                    return None
                return OutputProgress(self._global.last, self._epoch, self._epoch_step,
                                      step_time_ms=float(timed["step_time_ms"]))
        return None

    def _step_line(self, groups: dict[str, str | None]) -> OutputProgress | None:
        epoch, step, global_step = (_int(groups.get(name)) for name in ("epoch", "step", "global_step"))
        if global_step is not None:
            counted = self._global.count_global(global_step)
        elif step is None:
            return None  # an optional step group did not take part, or held no integer
        elif epoch is None:
            counted = self._global.count_global(step)
        else:
            counted = self._global.count_in_epoch(epoch, step)
        loss_text = groups.get("loss")
        self._epoch, self._epoch_step = epoch, step
        return OutputProgress(
            counted, epoch, step,
            loss=None if loss_text is None else parse_loss(loss_text),
            step_time_ms=_float(groups.get("step_time_ms")),
            samples_per_s=_float(groups.get("samples_per_s")),
        )


def _int(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def _float(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None
