"""GuardedTrainOneStepCell with real MindSpore in GRAPH mode, one process (a missing MindSpore fails these tests):
on good steps it updates exactly as nn.TrainOneStepCell does; a bad batch changes no weight, no optimizer state
and no guard state; micro batches accumulate to the mean of the whole batch; clipping bounds the update."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from trainer.checkpoint.mindspore_io import parameters_to_numpy
from trainer.runtime.guard_policy import GuardSettings, skip_reason
from trainer.runtime.guarded_cell import GuardedTrainOneStepCell

FEATURES, CLASSES, BATCH = 8, 3, 8


@pytest.fixture(scope="module", autouse=True)
def graph_mode() -> Iterator[None]:
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=previous)


def network_with_loss() -> tuple[nn.Cell, nn.Optimizer]:
    ms.set_seed(1)  # the same initial weights for every cell a test compares
    net = nn.SequentialCell(nn.Dense(FEATURES, 16), nn.ReLU(), nn.Dense(16, CLASSES))
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    return nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")), optimizer


def guarded(grad_accum: int = 1, **kwargs: object) -> GuardedTrainOneStepCell:
    cell = GuardedTrainOneStepCell(*network_with_loss(), grad_accum=grad_accum, environ={}, **kwargs)
    cell.set_train()
    return cell


def batches(count: int, size: int = BATCH, seed: int = 0) -> list[tuple[ms.Tensor, ms.Tensor]]:
    rng = np.random.default_rng(seed)
    return [(ms.Tensor(rng.standard_normal((size, FEATURES)).astype(np.float32)),
             ms.Tensor(rng.integers(0, CLASSES, size).astype(np.int32))) for _ in range(count)]


def state(cell: nn.Cell) -> dict[str, bytes]:
    return {name: array.tobytes() for name, array in parameters_to_numpy(cell).items()}


def test_good_steps_update_bit_for_bit_like_train_one_step_cell() -> None:
    plain = nn.TrainOneStepCell(*network_with_loss())
    plain.set_train()
    cell = guarded()
    for x, y in batches(6):
        loss, norm, accepted = cell(x, y)
        assert bool(accepted.asnumpy()) and np.isfinite(norm.asnumpy())
        assert loss.asnumpy().tobytes() == plain(x, y).asnumpy().tobytes()
        ours = state(cell)
        assert {name: ours[name] for name in state(plain)} == state(plain)  # weights, momenta, step
    assert int(cell.guard.accepted_steps.asnumpy()) == 6


def test_a_nan_batch_changes_no_weight_no_optimizer_state_and_no_guard_state() -> None:
    cell = guarded()
    good = batches(3)
    for x, y in good[:2]:
        cell(x, y)
    before = state(cell)
    x, y = good[2]
    poisoned = x.asnumpy().copy()
    poisoned[5] = np.nan
    loss, norm, accepted = cell(ms.Tensor(poisoned), y)
    reason = skip_reason(bool(accepted.asnumpy()), float(loss.asnumpy()), float(norm.asnumpy()))
    assert reason in ("nonfinite_loss", "nonfinite_grad_norm")
    assert state(cell) == before
    assert bool(cell(x, y)[2].asnumpy()) and state(cell) != before  # the next good batch trains again


def test_micro_batches_accumulate_to_the_whole_batch() -> None:
    whole, accumulated = guarded(), guarded(grad_accum=4)
    for x, y in batches(4, size=4 * BATCH, seed=1):
        loss_w, norm_w, _ = whole(x, y)
        loss_a, norm_a, _ = accumulated(x, y)
        np.testing.assert_allclose(loss_a.asnumpy(), loss_w.asnumpy(), rtol=1e-6)
        np.testing.assert_allclose(norm_a.asnumpy(), norm_w.asnumpy(), rtol=1e-5)
    for param_w, param_a in zip(whole.network.trainable_params(), accumulated.network.trainable_params()):
        np.testing.assert_allclose(param_a.asnumpy(), param_w.asnumpy(), rtol=1e-5, atol=1e-7)


def test_the_launch_sets_the_accumulation_and_a_batch_that_does_not_split_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # where MindSpore writes the failed compile's rank_0/om/analyze_fail.ir
    launch = {"TRAINERD_JOB": "cb", "TRAINERD_GLOBAL_BATCH": "24", "TRAINERD_MICRO_BATCH": "8",
              "TRAINERD_GRAD_ACCUM": "3"}
    cell = GuardedTrainOneStepCell(*network_with_loss(), environ=launch)
    assert cell.grad_accum == 3
    assert GuardedTrainOneStepCell(*network_with_loss(), environ={"TRAINERD_GRAD_ACCUM": "3"}).grad_accum == 1
    [(x, y)] = batches(1, size=10)
    with pytest.raises(ValueError, match="does not split into grad_accum micro batches"):
        cell(x, y)


def test_clipping_bounds_an_accepted_update() -> None:
    ms.set_seed(1)
    net = nn.Dense(FEATURES, CLASSES)
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    cell = GuardedTrainOneStepCell(nn.WithLossCell(net, loss), nn.SGD(net.trainable_params(), learning_rate=1.0),
                                   guard_settings=GuardSettings(), max_grad_norm=0.01, environ={})
    before = [p.asnumpy().copy() for p in net.trainable_params()]
    _, norm, accepted = cell(*batches(1)[0])
    step = np.sqrt(sum(np.sum((p.asnumpy() - b) ** 2) for p, b in zip(net.trainable_params(), before)))
    assert bool(accepted.asnumpy()) and float(norm.asnumpy()) > 0.01
    assert step == pytest.approx(0.01, rel=1e-4)  # SGD with rate 1 moves by the clipped gradient itself
