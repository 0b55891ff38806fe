"""The elastic sample stream (pure numpy): ledger validation, the step walk, the rank split, and property
tests of a job that resumes at other world sizes from checkpoints taken at step boundaries."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.data import SampleStream, SkipRanges, rank_share

PROPERTY_SETTINGS = settings(max_examples=150, derandomize=True, deadline=None, database=None)


def brute_force_positions(ledger: list[tuple[int, int]], end: int) -> list[int]:
    """Every stream position below `end` that no range of the (unnormalised) ledger covers."""
    return [p for p in range(end) if not any(start <= p < stop for start, stop in ledger)]


def example_job_indices(step: int, global_batch: int, seed: int, dataset_size: int) -> np.ndarray:
    """The example job's formula before issue 6 (trainer/examples/mlp.py global_batch_indices)."""
    positions = np.arange(step * global_batch, (step + 1) * global_batch)
    return np.array([np.random.default_rng([seed, p // dataset_size]).permutation(dataset_size)[p % dataset_size]
                     for p in positions])


# ---------------------------------------------------------------- the ledger

def test_ledger_sorts_and_merges_overlapping_and_touching_ranges() -> None:
    ledger = SkipRanges.of([[50, 60], (10, 20), [15, 30], [30, 35], [70, 71], [40, 45]])
    assert ledger.ranges == ((10, 35), (40, 45), (50, 60), (70, 71))
    assert ledger.to_json() == [[10, 35], [40, 45], [50, 60], [70, 71]]
    assert SkipRanges.of([]).ranges == ()
    assert SkipRanges.of([(np.int64(3), np.int32(4))]).ranges == ((3, 4),)


@pytest.mark.parametrize("ranges, message", [
    ([[0, 5], [-1, 3]], r"skip range #1 \[-1, 3\] starts before position 0"),
    ([[7, 7]], r"skip range #0 \[7, 7\] is empty"),
    ([[9, 4]], r"skip range #0 \[9, 4\] is empty"),
    ([[1.0, 4]], r"skip range #0 \[1.0, 4\] is not a pair of integers"),
    ([[True, 4]], r"skip range #0 \[True, 4\] is not a pair of integers"),
    ([[1, 2, 3]], r"skip range #0 \[1, 2, 3\] is not a pair"),
    ([5], r"skip range #0 5 is not a pair"),
    (["ab"], r"skip range #0 'ab' is not a pair"),
])
def test_ledger_refuses_a_bad_range_by_name(ranges: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SkipRanges.of(ranges)


def test_ledger_file(tmp_path: Path) -> None:
    path = tmp_path / "skips.json"
    assert SkipRanges.read(path) == SkipRanges()  # absent file: no skips
    path.write_text(json.dumps({"schema": 1, "ranges": [[128, 192], [0, 64]]}))
    assert SkipRanges.read(path).ranges == ((0, 64), (128, 192))
    for text, message in [
        ("{", "is not JSON"),
        (json.dumps({"schema": 2, "ranges": []}), "schema 2 is not 1"),
        (json.dumps({"schema": True, "ranges": []}), "schema True is not 1"),
        (json.dumps({"schema": 1}), "must be"),
        (json.dumps({"schema": 1, "ranges": {}}), "must be a list"),
        (json.dumps({"schema": 1, "ranges": [[5, 1]]}), r"skip range #0 \[5, 1\] is empty"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message) as caught:
            SkipRanges.read(path)
        assert str(path) in str(caught.value)


# ---------------------------------------------------------------- the stream

def test_without_a_ledger_the_order_is_the_example_jobs() -> None:
    stream = SampleStream(dataset_size=40, seed=5)
    for step in range(7):  # 7 × 16 positions cross two epoch boundaries
        positions, consumed = stream.step_positions(step * 16, 16)
        assert consumed == (step + 1) * 16
        assert np.array_equal(positions, np.arange(step * 16, (step + 1) * 16))
        assert np.array_equal(stream.indices(positions), example_job_indices(step, 16, 5, 40))


def test_step_walks_around_the_ledger() -> None:
    stream = SampleStream(dataset_size=100, seed=0, skips=[[0, 3], [6, 8], [12, 20]])
    positions, consumed = stream.step_positions(0, 4)
    assert positions.tolist() == [3, 4, 5, 8] and consumed == 9
    positions, consumed = stream.step_positions(9, 3)  # ends right before a skipped range
    assert positions.tolist() == [9, 10, 11] and consumed == 12
    positions, consumed = stream.step_positions(consumed, 2)  # starts inside it
    assert positions.tolist() == [20, 21] and consumed == 22
    positions, consumed = stream.step_positions(14, 1)  # a resume point inside a range
    assert positions.tolist() == [20] and consumed == 21


def test_resume_far_into_the_stream_does_no_replay() -> None:
    ledger = [[i * 1000, i * 1000 + 10] for i in range(10_000)]
    stream = SampleStream(dataset_size=1000, seed=1, skips=ledger)
    started = time.perf_counter()
    positions, consumed = stream.step_positions(10**15, 64)
    indices = stream.indices(positions)
    assert time.perf_counter() - started < 1.0
    assert positions.tolist() == list(range(10**15, 10**15 + 64)) and consumed == 10**15 + 64
    positions, consumed = stream.step_positions(5_000_995, 10)  # mid-ledger: bisect, not a scan
    assert positions.tolist() == [*range(5_000_995, 5_001_000), *range(5_001_010, 5_001_015)]
    assert indices.min() >= 0 and indices.max() < 1000


def test_rank_share_is_a_contiguous_block_in_micro_batches() -> None:
    batch = np.arange(100, 124)
    assert rank_share(batch, 1, 3, 4).tolist() == [[108, 109, 110, 111], [112, 113, 114, 115]]
    assert rank_share(batch, 0, 1, 24).shape == (1, 24)
    with pytest.raises(ValueError, match="does not split over 5 ranks"):
        rank_share(batch, 0, 5, 1)
    with pytest.raises(ValueError, match="12 samples per step do not split into micro batches of 5"):
        rank_share(batch, 0, 2, 5)
    with pytest.raises(ValueError, match="rank 3 is not below the world size 3"):
        rank_share(batch, 3, 3, 4)


@pytest.mark.parametrize("kwargs, message", [
    ({"dataset_size": 0, "seed": 0}, "dataset_size must be at least 1"),
    ({"dataset_size": 10, "seed": -1}, "seed must be at least 0"),
    ({"dataset_size": 10.0, "seed": 0}, "dataset_size must be an integer"),
])
def test_stream_refuses_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SampleStream(**kwargs)


def test_step_refuses_bad_arguments() -> None:
    stream = SampleStream(10, 0)
    with pytest.raises(ValueError, match="consumed_samples must be at least 0"):
        stream.step_positions(-1, 4)
    with pytest.raises(ValueError, match="global_batch must be at least 1"):
        stream.step_positions(0, 0)


def test_rank_indices_are_the_steps_rank_shares() -> None:
    stream = SampleStream(dataset_size=30, seed=9, skips=[[10, 25]])
    schedule, consumed = stream.rank_indices(4, 12, rank=2, world_size=3, steps=5)
    assert schedule.shape == (5, 4)
    expected, position = [], 4
    for _ in range(5):
        positions, position = stream.step_positions(position, 12)
        expected.append(stream.indices(positions[8:12]))
    assert np.array_equal(schedule, np.array(expected)) and consumed == position


# ---------------------------------------------------------------- properties of a whole job

LEDGERS = st.lists(st.tuples(st.integers(0, 150), st.integers(1, 25)).map(lambda r: (r[0], r[0] + r[1])),
                   max_size=5)
# A job's life: segments of (steps, world size), each resumed from the checkpoint the previous one ended with.
SEGMENTS = st.lists(st.tuples(st.integers(0, 6), st.sampled_from([1, 2, 3, 4, 6])), min_size=1, max_size=5)


@PROPERTY_SETTINGS
@given(dataset_size=st.integers(1, 40), seed=st.integers(0, 2**32), batch_units=st.integers(1, 3),
       ledger=LEDGERS, segments=SEGMENTS, grad_accum_pick=st.integers(0, 10))
def test_a_resized_job_reads_every_position_once_except_the_ledgers(
        dataset_size: int, seed: int, batch_units: int, ledger: list[tuple[int, int]],
        segments: list[tuple[int, int]], grad_accum_pick: int) -> None:
    global_batch = 12 * batch_units  # divisible by every world size drawn
    consumed = 0
    read: list[int] = []  # positions, in the order the job reads them
    index_of: dict[int, int] = {}
    for steps, world_size in segments:
        stream = SampleStream(dataset_size, seed, ledger)  # a restart builds its stream afresh
        per_rank = global_batch // world_size
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        micro_batch = per_rank // divisors[grad_accum_pick % len(divisors)]
        for _ in range(steps):
            positions, next_consumed = stream.step_positions(consumed, global_batch)
            assert next_consumed == positions[-1] + 1 and positions[0] >= consumed
            shares = [rank_share(positions, rank, world_size, micro_batch) for rank in range(world_size)]
            assert all(share.shape == (per_rank // micro_batch, micro_batch) for share in shares)
            # the ranks' shares are disjoint and together are the step
            assert np.array_equal(np.concatenate([share.ravel() for share in shares]), positions)
            for share in shares:
                indices = stream.indices(share)
                assert indices.shape == share.shape
                for position, index in zip(share.ravel().tolist(), indices.ravel().tolist()):
                    index_of[position] = index
            read.extend(positions.tolist())
            consumed = next_consumed

    # every position before the final consumed count is read exactly once, unless the ledger skips it
    assert len(read) == len(set(read)) == sum(steps for steps, _ in segments) * global_batch
    assert read == brute_force_positions(ledger, consumed)
    # the same positions as one uninterrupted single-rank run
    uninterrupted, position = [], 0
    plain = SampleStream(dataset_size, seed, ledger)
    while position < consumed:
        positions, position = plain.step_positions(position, global_batch)
        uninterrupted.extend(positions.tolist())
    assert read == uninterrupted
    # per epoch: the dataset indices read are that epoch's permutation at the offsets not skipped, once each
    for epoch in range(math.ceil(consumed / dataset_size)):
        order = np.random.default_rng([seed, epoch]).permutation(dataset_size)
        offsets = [p - epoch * dataset_size for p in brute_force_positions(ledger, consumed)
                   if p // dataset_size == epoch]
        got = Counter(index for position, index in index_of.items() if position // dataset_size == epoch)
        assert got == Counter(order[offsets].tolist())
        assert max(got.values(), default=1) == 1


@PROPERTY_SETTINGS
@given(ledger=LEDGERS, consumed=st.integers(0, 200), global_batch=st.integers(1, 30))
def test_a_step_is_the_next_unskipped_positions(ledger: list[tuple[int, int]], consumed: int,
                                                global_batch: int) -> None:
    positions, next_consumed = SampleStream(7, 0, ledger).step_positions(consumed, global_batch)
    expected = [p for p in brute_force_positions(ledger, consumed + global_batch + 200) if p >= consumed]
    assert positions.tolist() == expected[:global_batch]
    assert next_consumed == expected[global_batch - 1] + 1
