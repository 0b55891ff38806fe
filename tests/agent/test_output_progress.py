"""Progress read from an unmodified script's output: MindSpore's LossMonitor/TimeMonitor, a job's pattern.

The files in mindspore_output/ are real output of MindSpore 2.10 on CPU (Model.train with
LossMonitor and TimeMonitor; paths replaced).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.output_progress import (
    MAX_LINE_BYTES,
    EpochShape,
    OutputProgress,
    OutputProgressParser,
    parse_loss,
)
from proto.progress_pattern import ProgressPatternError, compile_progress_pattern

SAMPLES = Path(__file__).parent / "mindspore_output"


def feed_all(data: bytes, parser: OutputProgressParser | None = None) -> list[OutputProgress]:
    parser = parser or OutputProgressParser()
    return parser.feed(data) + parser.close()


def loss_monitor_lines(epochs: int, batch_num: int, per_print_times: int = 1, first_epoch: int = 1) -> list[str]:
    """What LossMonitor.step_end prints (mindspore/train/callback/_loss_monitor.py, 2.10)."""
    lines, last_print = [], (first_epoch - 1) * batch_num
    for cur_step_num in range((first_epoch - 1) * batch_num + 1, (first_epoch - 1 + epochs) * batch_num + 1):
        epoch = (cur_step_num - 1) // batch_num + 1
        if cur_step_num - last_print >= per_print_times:
            last_print = cur_step_num
            lines.append(f"epoch: {epoch} step: {(cur_step_num - 1) % batch_num + 1}, loss is 0.5\n")
    return lines


def test_real_loss_and_time_monitor_output() -> None:
    observations = feed_all((SAMPLES / "loss_and_time_monitor.txt").read_bytes())
    steps = [o for o in observations if o.loss is not None]
    assert [(o.step, o.epoch, o.epoch_step) for o in steps] == [
        (1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 2, 1), (5, 2, 2), (6, 2, 3), (7, 3, 1), (8, 3, 2), (9, 3, 3)]
    assert steps[0].loss == 1.105197548866272 and steps[-1].loss == 0.011879591271281242
    # Two TimeMonitors, one with data_time: each epoch-end line is reported against the epoch's last step.
    timed = [(o.step, o.step_time_ms) for o in observations if o.step_time_ms is not None]
    assert timed == [(3, 263.441), (3, 263.475), (6, 2.882), (6, 2.912), (9, 4.799), (9, 4.825)]
    assert all(o.loss is None for o in observations if o.step_time_ms is not None)


def test_real_loss_monitor_output_of_a_tuple_network_prints_arrays() -> None:
    observations = feed_all((SAMPLES / "loss_monitor_array_loss.txt").read_bytes())
    assert [o.loss for o in observations if o.loss is not None][:3] == [1.4950818, 7.4544163, 3.096862]
    assert [o.step for o in observations if o.loss is not None] == list(range(1, 10))


def test_loss_monitors_error_on_a_nan_loss_is_not_a_step_line() -> None:
    observations = feed_all((SAMPLES / "loss_monitor_nan.txt").read_bytes())
    assert observations == [OutputProgress(step=1, epoch=1, epoch_step=1, loss=0.4243205785751343)]


@pytest.mark.parametrize(("printed", "loss"), [
    ("0.6931471824645996", 0.6931471824645996),                                # a tensor output, as float
    ("0.7690566", 0.7690566),                                                  # str() of a scalar tensor
    ("[1.4950818]", 1.4950818),                                                # str() of a shape-[1] tensor
    ("[0.5  0.25]", 0.375),                                                    # several values: their mean
    ("(Tensor(shape=[], dtype=Float32, value= 0.693),)", 0.693),               # a tuple of tensors
    ("Tensor(shape=[1], dtype=Float32, value= [ 6.93000019e-01])", 0.693000019),
    ("Tensor(shape=[2], dtype=Float32, value= [ 1.00000001e-01,  2.00000003e-01])", 0.150000002),
    ("(1.0, 2)", 1.0),
    ("-2.5e-3", -0.0025),
])
def test_printed_losses(printed: str, loss: float) -> None:
    assert parse_loss(printed) == pytest.approx(loss)


@pytest.mark.parametrize(("printed", "check"), [
    ("nan", math.isnan),
    ("Tensor(shape=[], dtype=Float32, value= nan)", math.isnan),
    ("[            inf]", lambda value: value == math.inf),
    ("-inf", lambda value: value == -math.inf),
    ("[nan 1.0]", math.isnan),
])
def test_non_finite_losses_are_reported(printed: str, check) -> None:
    assert check(parse_loss(printed))
    observations = feed_all(f"epoch: 1 step: 1, loss is {printed}\n".encode())
    assert len(observations) == 1 and check(observations[0].loss)


@pytest.mark.parametrize("printed", [
    "[[1.0e-08 2.5e+00]",                        # a 2-D tensor whose rows continue on the next lines
    "Tensor(shape=[2, 2], dtype=Float32, value=",
    "information", "0.693abc", "", "None",
])
def test_unreadable_losses_are_none_and_the_step_still_counts(printed: str) -> None:
    assert parse_loss(printed) is None
    assert feed_all(f"epoch: 2 step: 7, loss is {printed}\n".encode()) == [
        OutputProgress(step=7, epoch=2, epoch_step=7, loss=None)]


def test_the_global_step_is_exact_when_every_step_is_printed() -> None:
    observations = feed_all("".join(loss_monitor_lines(epochs=4, batch_num=5)).encode())
    assert [o.step for o in observations] == list(range(1, 21))


def test_the_global_step_with_sparse_printing_lags_at_most_one_epoch_and_never_decreases() -> None:
    # per_print_times=10 with 25 steps an epoch: epoch 1 prints steps 10, 20; epoch 2 prints 5, 15, 25; ...
    lines = loss_monitor_lines(epochs=6, batch_num=25, per_print_times=10)
    observations = feed_all("".join(lines).encode())
    true_steps = list(range(10, 151, 10))
    assert len(observations) == len(true_steps)
    derived = [o.step for o in observations]
    assert derived == sorted(derived) and len(set(derived)) == len(derived)
    assert all(0 <= true - got <= 25 for true, got in zip(true_steps, derived))
    assert derived[-1] == 150  # exact again once an epoch printed its last step


def test_the_official_msrun_sample_format_counts_from_zero() -> None:
    # print("epoch: %s, step: %s, loss is %s" % (epoch, i, loss)) every 10 steps, epoch and i from 0.
    lines = [f"epoch: {epoch}, step: {i}, loss is 2.30\n" for epoch in range(3) for i in range(0, 100, 10)]
    derived = [o.step for o in feed_all("".join(lines).encode())]
    assert derived[:10] == list(range(0, 100, 10))
    assert derived[10] == 91  # steps per epoch learnt as 90 + 1 (counted from 0)
    assert derived == sorted(derived) and len(set(derived)) == len(derived)


def test_a_resumed_run_counts_its_first_epoch_from_1_then_the_true_global_step() -> None:
    """Steps per epoch are unknown until the epoch changes; from then on the step is the run's own
    (a script that resumed after 4 epochs of 4 steps is at step 21 in epoch 6, not 5)."""
    observations = feed_all("".join(loss_monitor_lines(epochs=3, batch_num=4, first_epoch=5)).encode())
    assert [(o.epoch, o.epoch_step, o.step) for o in observations] == [
        (5, 1, 1), (5, 2, 2), (5, 3, 3), (5, 4, 4), (6, 1, 21), (6, 2, 22), (6, 3, 23), (6, 4, 24),
        (7, 1, 25), (7, 2, 26), (7, 3, 27), (7, 4, 28)]


def test_a_resumed_run_given_the_shape_an_earlier_run_learnt_counts_true_from_its_first_line() -> None:
    first = OutputProgressParser()
    feed_all("".join(loss_monitor_lines(epochs=2, batch_num=4)).encode(), first)
    assert first.epoch_shape == EpochShape(1, 4, False)
    resumed = OutputProgressParser(shape=first.epoch_shape)
    observations = feed_all("".join(loss_monitor_lines(epochs=2, batch_num=4, first_epoch=5)).encode(), resumed)
    assert [o.step for o in observations] == list(range(17, 25))  # epoch 5 step 1 is the run's step 17
    # The official samples' format, counted from 0: the shape keeps that too.
    zero = [f"epoch: {epoch}, step: {i}, loss is 2.30\n" for epoch in range(2) for i in range(10)]
    learnt = OutputProgressParser()
    feed_all("".join(zero).encode(), learnt)
    assert learnt.epoch_shape == EpochShape(0, 10, True)
    later = [f"epoch: {epoch}, step: {i}, loss is 2.30\n" for epoch in (3, 4) for i in range(10)]
    assert [o.step for o in feed_all("".join(later).encode(), OutputProgressParser(shape=learnt.epoch_shape))] == (
        list(range(30, 50)))


def test_a_second_training_in_the_same_process_continues_the_count() -> None:
    lines = loss_monitor_lines(epochs=2, batch_num=3) + loss_monitor_lines(epochs=1, batch_num=4)
    assert [o.step for o in feed_all("".join(lines).encode())] == list(range(1, 11))


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40)), max_size=60),
       st.none() | st.builds(EpochShape, st.integers(0, 1), st.integers(1, 50), st.booleans()))
@settings(max_examples=300, deadline=None)
def test_the_global_step_never_decreases(positions: list[tuple[int, int]], shape: EpochShape | None) -> None:
    """Whatever is printed, and whatever shape an earlier run left (a wrong one too)."""
    data = "".join(f"epoch: {epoch} step: {step}, loss is 1.0\n" for epoch, step in positions).encode()
    derived = [o.step for o in feed_all(data, OutputProgressParser(shape=shape))]
    assert len(derived) == len(positions)
    assert derived == sorted(derived)


def test_step_times_need_a_step_and_eval_times_are_not_training() -> None:
    data = (b"Train epoch time: 790.323 ms, per step time: 263.441 ms\n"  # before any step: dropped
            b"epoch: 1 step: 3, loss is 0.1\n"
            b"Eval epoch time: 12.000 ms, per step time: 4.000 ms\n"
            b" epoch time: 30.000 ms, per step time: 10.000 ms\n"      # TimeMonitor with an empty mode
            b"Train per step time: 1.317 ms mfu:48.59% hfu:48.59%\n")    # FlopsUtilizationCollector
    assert feed_all(data) == [
        OutputProgress(step=3, epoch=1, epoch_step=3, loss=0.1),
        OutputProgress(step=3, epoch=1, epoch_step=3, step_time_ms=10.0),
        OutputProgress(step=3, epoch=1, epoch_step=3, step_time_ms=1.317),
    ]


def test_other_lines_say_nothing() -> None:
    data = (b"[WARNING] ME(1:2,MainProcess):2026-11-23-09:00:00.000.000 [x.py:1] epoch: 1 step: x\n"
            b"Eval result: epoch 1, metrics: {'acc': 0.9}\n"
            b"Start worker process with rank id:0, log file:worker_0.log.\n\n\n")
    assert feed_all(data) == []


def test_a_job_pattern_replaces_the_loss_monitor_formats() -> None:
    pattern = compile_progress_pattern(
        r"Epoch:\[\s*(?P<epoch>\d+)/\s*\d+\], step:\[\s*(?P<step>\d+)/\s*\d+\], loss: (?P<loss>\S+?),"
        r".* samples/s: (?P<samples_per_s>[\d.]+)")
    data = (b"{ Epoch:[  1/  2], step:[    9/   10], loss: 10.375, per_step_time: 512ms, samples/s: 62.5 }\n"
            b"epoch: 1 step: 1, loss is 0.5\n"
            b"{ Epoch:[  1/  2], step:[   10/   10], loss: nan, per_step_time: 500ms, samples/s: 64.0 }\n"
            b"{ Epoch:[  2/  2], step:[    1/   10], loss: 9.5, per_step_time: 500ms, samples/s: 64.0 }\n")
    observations = feed_all(data, OutputProgressParser(pattern))
    assert [(o.step, o.epoch, o.epoch_step, o.samples_per_s) for o in observations] == [
        (9, 1, 9, 62.5), (10, 1, 10, 64.0), (11, 2, 1, 64.0)]
    assert observations[0].loss == 10.375 and math.isnan(observations[1].loss)


def test_a_job_pattern_with_a_global_step_or_a_step_alone() -> None:
    global_pattern = compile_progress_pattern(
        r"iter (?P<global_step>\d+) epoch (?P<epoch>\d+) loss (?P<loss>\S+) (?P<step_time_ms>[\d.]+) ms")
    observations = feed_all(b"iter 1200 epoch 3 loss 0.25 812.5 ms\niter 1201 epoch 3 loss 0.5 800 ms\n",
                            OutputProgressParser(global_pattern))
    assert observations == [OutputProgress(step=1200, epoch=3, loss=0.25, step_time_ms=812.5),
                            OutputProgress(step=1201, epoch=3, loss=0.5, step_time_ms=800.0)]
    step_pattern = compile_progress_pattern(r"^step (?P<step>\d+)(?: loss (?P<loss>\S+))?")
    observations = feed_all(b"step 40 loss 1.5\nstep 41\nstep x\n", OutputProgressParser(step_pattern))
    assert [(o.step, o.epoch, o.loss) for o in observations] == [(40, None, 1.5), (41, None, None)]


@pytest.mark.parametrize(("pattern", "error"), [
    (r"loss (?P<loss>\S+)", "needs a named group 'step' (or 'global_step'), as in (?P<step>\\d+)"),
    (r"step (?P<step>\d+) lr (?P<lr>\S+)",
     "unknown named group 'lr' (allowed: epoch, global_step, loss, samples_per_s, step, step_time_ms)"),
    (r"step (?P<step>\d+",
     "not a valid regular expression: missing ), unterminated subpattern at position 5"),
])
def test_a_bad_job_pattern_is_refused_in_one_line(pattern: str, error: str) -> None:
    with pytest.raises(ProgressPatternError) as raised:
        compile_progress_pattern(pattern)
    assert str(raised.value) == error


def test_lines_split_across_reads_and_carriage_returns() -> None:
    parser = OutputProgressParser()
    assert parser.feed(b"epoch: 1 st") == []
    assert parser.feed(b"ep: 1, loss is 0.") == []
    assert parser.feed(b"25\r\nepoch: 1 step: 2, loss is 0.2\rprogress 50%\repoch: 1 step: 3") == [
        OutputProgress(step=1, epoch=1, epoch_step=1, loss=0.25),
        OutputProgress(step=2, epoch=1, epoch_step=2, loss=0.2)]
    assert parser.feed(b", loss is 0.1") == []
    assert parser.close() == [OutputProgress(step=3, epoch=1, epoch_step=3, loss=0.1)]
    assert parser.close() == []


def test_a_very_long_line_is_cut_and_the_next_line_still_read() -> None:
    parser = OutputProgressParser()
    long_line = b"x" * (MAX_LINE_BYTES - 10) + b"epoch: 1 step: 1, loss is 0.5"  # the match lies past the cut
    assert parser.feed(long_line) == []
    assert parser.feed(b"y" * 1_000_000) == []
    assert len(parser._line) == MAX_LINE_BYTES  # the rest of the line is dropped, not buffered
    assert parser.feed(b"\nepoch: 1 step: 2, loss is 0.4\n") == [
        OutputProgress(step=2, epoch=1, epoch_step=2, loss=0.4)]


def test_bytes_that_are_not_utf8_are_replaced() -> None:
    data = b"\xff\xfe\x80 garbage\nepoch: 1 step: 1, loss is 0.5 \xe2\x82\n\xc3(garbage\x00\n"
    assert feed_all(data) == [OutputProgress(step=1, epoch=1, epoch_step=1, loss=0.5)]


OUTPUT_PIECES = st.sampled_from([
    b"epoch: 1 step: 1, loss is 0.6931471824645996\n", b"epoch: 1 step: 2, loss is [0.5]\n",
    b"epoch: 2 step: 1, loss is nan\n", b"epoch: 2 step: 2, loss is (Tensor(shape=[], dtype=Float32, value= 0.4),)\n",
    b"epoch: 0, step: 0, loss is 2.30\n", b"epoch: 1 step: 1, loss is 0.1\n",
    b"Train epoch time: 790.323 ms, per step time: 263.441 ms\n",
    b"Train per step time: 1.317 ms mfu:48.59% hfu:48.59%\n",
    b"[WARNING] ME(1:2,MainProcess):2026-11-23-09:00:00.000.000 [x.py:1] hello\n",
    b"\r", b"\n", b"\r\n", b"\xff\xc3\xe2\x82", "épоch: 1 step: 1 — ünïcode\n".encode(),
    b"z" * (MAX_LINE_BYTES - 5), b"epoch: 3 step: 9, loss is 1e-3", b"iter 7 loss 0.5 ", b"iter 8\n",
])
UNANCHORED = compile_progress_pattern(r"iter (?P<global_step>\d+)(?: loss (?P<loss>\S+))?")


@given(st.lists(OUTPUT_PIECES, max_size=30), st.lists(st.integers(0, 10**6), max_size=12), st.booleans())
@settings(max_examples=400, deadline=None)
def test_any_split_of_the_same_bytes_gives_the_same_observations(
        pieces: list[bytes], cuts: list[int], with_pattern: bool) -> None:
    pattern = UNANCHORED if with_pattern else None
    data = b"".join(pieces)
    whole = feed_all(data, OutputProgressParser(pattern))
    bounds = [0, *sorted(cut % (len(data) + 1) for cut in cuts), len(data)]
    parser = OutputProgressParser(pattern)
    split: list[OutputProgress] = []
    for start, end in itertools.pairwise(bounds):
        split.extend(parser.feed(data[start:end]))
    split.extend(parser.close())
    assert _comparable(split) == _comparable(whole)


def _comparable(observations: list[OutputProgress]) -> list[tuple]:
    """NaN != NaN: compare losses by their text."""
    return [(o.step, o.epoch, o.epoch_step, repr(o.loss), o.step_time_ms, o.samples_per_s) for o in observations]
