"""The guarded step with real MindSpore in GRAPH mode, one process (a missing MindSpore fails these tests):
bad batches leave the weights, the optimizer and the guard untouched; good ones update bit-for-bit like an
unguarded step; the guard's state survives a checkpoint round trip; the cell follows the pure rule."""

from __future__ import annotations

import math
from collections.abc import Iterator

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from trainer.checkpoint.mindspore_io import load_numpy_into, parameters_to_numpy
from trainer.runtime.guard import ACCEPTED_STEPS, NORM_MEAN, GuardedApplyGradients, StepGuard, mean_over_ranks
from trainer.runtime.guard_policy import (
    SKIP_REASONS,
    GuardSettings,
    GuardState,
    decide,
    skip_reason,
)

MICRO_BATCHES = 2  # the sums are divided by 2: exact in float32, so a reference can be handed the mean
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module", autouse=True)
def graph_mode() -> Iterator[None]:
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=previous)


class Rig:
    """A Dense layer with Adam behind a guarded (or, with settings=None, unguarded) apply step, whose
    gradient sums the test sets directly."""

    def __init__(self, settings: GuardSettings | None, max_grad_norm: float | None = 5.0) -> None:
        ms.set_seed(3)
        self.net = nn.Dense(6, 4)
        self.optimizer = nn.Adam(self.net.trainable_params(), learning_rate=0.05)
        self.grad_sums = self.optimizer.parameters.clone(prefix="grad_sum", init="zeros")
        self.guard = StepGuard(settings) if settings is not None else None
        self.apply = GuardedApplyGradients(self.optimizer, self.grad_sums, nn.Identity(), mean_over_ranks(1),
                                           self.guard, max_grad_norm)

    def step(self, grads: list[np.ndarray], loss: float = 1.0) -> tuple[float, float, str | None]:
        for grad_sum, grad in zip(self.grad_sums, grads):
            grad_sum.set_data(ms.Tensor(grad * MICRO_BATCHES))
        losses = (ms.Tensor(loss, ms.float32), ms.Tensor(loss, ms.float32))
        loss_t, norm_t, accepted = self.apply(ms.Tensor(MICRO_BATCHES, ms.float32), *losses)
        assert all(not grad_sum.asnumpy().any() for grad_sum in self.grad_sums), "the sums are cleared"
        loss, norm = float(loss_t.asnumpy()), float(norm_t.asnumpy())
        return loss, norm, skip_reason(bool(accepted.asnumpy()), loss, norm)

    def state(self) -> dict[str, bytes]:
        cells = [self.net, self.optimizer] + ([self.guard] if self.guard is not None else [])
        return {name: array.tobytes() for name, array in parameters_to_numpy(*cells).items()}

    def guard_state(self) -> GuardState:
        return GuardState(float(self.guard.norm_mean.asnumpy()), int(self.guard.accepted_steps.asnumpy()))


def gradients(rng: np.random.Generator, scale: float = 1.0) -> list[np.ndarray]:
    """Gradients for the Dense(6, 4) weight and bias with a norm of about 5 × scale."""
    return [(rng.standard_normal((4, 6)) * scale).astype(np.float32),
            (rng.standard_normal(4) * scale).astype(np.float32)]


@pytest.mark.parametrize("bad_loss", [NAN, INF, -INF])
def test_a_nonfinite_loss_changes_nothing(bad_loss: float) -> None:
    rig, rng = Rig(GuardSettings(warmup_steps=2)), np.random.default_rng(0)
    for _ in range(3):
        assert rig.step(gradients(rng))[2] is None
    before = rig.state()
    loss, norm, reason = rig.step(gradients(rng), loss=bad_loss)
    assert reason == "nonfinite_loss" and not math.isfinite(loss) and math.isfinite(norm)
    assert rig.state() == before  # weights, Adam moments and step, guard mean and count
    assert rig.step(gradients(rng))[2] is None and rig.state() != before


def test_a_nonfinite_gradient_changes_nothing() -> None:
    rig, rng = Rig(GuardSettings()), np.random.default_rng(1)
    rig.step(gradients(rng))
    before = rig.state()
    grads = gradients(rng)
    grads[1][2] = np.inf
    assert rig.step(grads)[2] == "nonfinite_grad_norm"
    grads[1][2] = np.nan
    assert rig.step(grads)[2] == "nonfinite_grad_norm"
    assert rig.state() == before


def test_a_spike_after_warmup_is_skipped_and_leaves_the_running_mean() -> None:
    rig, rng = Rig(GuardSettings(spike_factor=3.0, warmup_steps=3)), np.random.default_rng(2)
    rig.step(gradients(rng))
    assert rig.step(gradients(rng, scale=10))[2] is None  # a spike within the warm-up is accepted
    rig.step(gradients(rng))
    mean = rig.guard_state().norm_mean
    before = rig.state()
    _, norm, reason = rig.step(gradients(rng, scale=30))
    assert reason == "grad_norm_spike" and norm > 3 * mean
    assert rig.state() == before and rig.guard_state() == GuardState(mean, 3)
    assert rig.step(gradients(rng))[2] is None and rig.guard_state().accepted_steps == 4


@pytest.mark.parametrize("max_grad_norm", [None, 5.0])
def test_good_steps_update_bit_for_bit_like_an_unguarded_step(max_grad_norm: float | None) -> None:
    guarded, unguarded = Rig(GuardSettings(warmup_steps=100), max_grad_norm), Rig(None, max_grad_norm)
    plain = _PlainUpdate(Rig(None))  # no guard, no clipping: the optimizer alone
    assert guarded.state() == {**unguarded.state(), **guarded.state()} and plain.rig.state() == unguarded.state()
    rng = np.random.default_rng(4)
    for step in range(6):
        grads = gradients(rng, scale=2.0 if step % 2 else 0.5)  # norms of about 10 and 2.5: some are clipped
        results = guarded.step(grads), unguarded.step(grads)
        assert results[0] == results[1] and results[0][2] is None
        if max_grad_norm is None:
            plain(grads)
    net_state = {name: state for name, state in guarded.state().items() if not name.startswith("guard.")}
    assert net_state == unguarded.state()
    if max_grad_norm is None:
        assert net_state == plain.rig.state()


def test_losses_are_step_inputs_not_graph_constants(caplog: pytest.LogCaptureFixture) -> None:
    """MindSpore folds Tensors inside a tuple argument into the graph, and recompiles when they change."""
    rig, rng = Rig(GuardSettings()), np.random.default_rng(7)
    for loss in (0.5, 0.25, 2.0):
        assert rig.step(gradients(rng), loss=loss)[0] == loss
    assert not [r for r in caplog.records if "Constant value tensor" in r.getMessage()]


class _PlainUpdate:
    """optimizer(grads) in a graph of its own: what an accepted, unclipped step must amount to."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.update = _OptimizerCell(rig.optimizer)

    def __call__(self, grads: list[np.ndarray]) -> None:
        self.update(tuple(ms.Tensor(grad) for grad in grads))


class _OptimizerCell(nn.Cell):
    def __init__(self, optimizer: nn.Optimizer) -> None:
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer

    def construct(self, grads: tuple) -> ms.Tensor:
        return self.optimizer(grads)


def test_the_guard_state_round_trips_through_a_checkpoint() -> None:
    settings = GuardSettings(spike_factor=2.0, warmup_steps=2, mean_horizon=3)
    original, rng = Rig(settings), np.random.default_rng(5)
    for scale in (1.0, 1.5, 0.5, 1.0):
        original.step(gradients(rng, scale))
    saved = {name: array.copy() for name, array in parameters_to_numpy(original.net, original.optimizer,
                                                                         original.guard).items()}
    assert saved[ACCEPTED_STEPS].dtype == np.int32 and saved[ACCEPTED_STEPS] == 4
    assert saved[NORM_MEAN].dtype == np.float32 and saved[NORM_MEAN] > 0

    restored = Rig(settings)
    assert restored.state() != original.state()
    load_numpy_into(saved, restored.net, restored.optimizer, restored.guard)
    assert restored.state() == original.state()
    for scale in (1.0, 2.5, 1.2, 4.0, 0.8):  # spikes judged against the restored mean
        grads = gradients(rng, scale)
        assert restored.step(grads) == original.step(grads)
    assert restored.state() == original.state()


class _GuardOnly(nn.Cell):
    def __init__(self, guard: StepGuard) -> None:
        super().__init__(auto_prefix=False)
        self.guard = guard

    def construct(self, loss: ms.Tensor, norm: ms.Tensor) -> ms.Tensor:
        return self.guard(loss, norm)


def test_the_cell_follows_the_pure_rule_bit_for_bit() -> None:
    settings = GuardSettings(spike_factor=2.5, warmup_steps=4, mean_horizon=6)
    cell, state = _GuardOnly(StepGuard(settings)), GuardState()
    rng = np.random.default_rng(6)
    reasons = set()
    for i in range(80):
        norm = float(rng.lognormal(0.0, 0.6)) if i % 11 else float(rng.choice([NAN, INF, -INF, 40.0]))
        loss = float(rng.choice([NAN, INF, -INF])) if i % 17 == 5 else float(rng.random())
        reason, state = decide(settings, state, loss, norm)
        accepted = bool(cell(ms.Tensor(loss, ms.float32), ms.Tensor(norm, ms.float32)).asnumpy())
        assert skip_reason(accepted, loss, norm) == reason, f"step {i}: loss {loss} norm {norm}"
        reasons.add(reason)
        assert np.float32(cell.guard.norm_mean.asnumpy()).tobytes() == np.float32(state.norm_mean).tobytes()
        assert int(cell.guard.accepted_steps.asnumpy()) == state.accepted_steps
    assert state.accepted_steps > settings.mean_horizon  # the moving-average regime was reached
    assert reasons == {None, *SKIP_REASONS}


def test_the_cell_follows_the_pure_rule_at_the_edges() -> None:
    """A norm exactly at the limit is no spike; an infinite factor turns spikes off even with a zero mean;
    a running mean so large that factor × mean overflows float32 still refuses an infinite norm."""
    biggest = float(np.finfo(np.float32).max)
    for settings, norms in [
        (GuardSettings(spike_factor=2.0, warmup_steps=1), [4.0, 8.0, 8.0, 24.0, 24.001]),
        (GuardSettings(spike_factor=INF, warmup_steps=1), [0.0, 0.0, 1e30, INF, NAN]),
        (GuardSettings(spike_factor=3.0, warmup_steps=1), [biggest, biggest, INF, 1.0]),
    ]:
        cell, state = _GuardOnly(StepGuard(settings)), GuardState()
        for norm in norms:
            reason, state = decide(settings, state, 0.5, norm)
            accepted = bool(cell(ms.Tensor(0.5, ms.float32), ms.Tensor(norm, ms.float32)).asnumpy())
            assert skip_reason(accepted, 0.5, norm) == reason, f"{settings}: norm {norm}"
            assert np.float32(cell.guard.norm_mean.asnumpy()).tobytes() == np.float32(state.norm_mean).tobytes()


def test_the_pure_rule() -> None:
    settings = GuardSettings(spike_factor=3.0, warmup_steps=2, mean_horizon=2)
    reason, state = decide(settings, GuardState(), 1.0, 100.0)
    assert (reason, state) == (None, GuardState(100.0, 1))  # no spike check in the warm-up
    reason, state = decide(settings, state, 1.0, 2.0)
    assert (reason, state) == (None, GuardState(51.0, 2))  # the true mean of 100 and 2
    assert decide(settings, state, 1.0, 153.5) == ("grad_norm_spike", state)
    reason, state = decide(settings, state, 1.0, 153.0)  # not above 3 × 51; then an EMA with weight 1/2
    assert (reason, state) == (None, GuardState(102.0, 3))
    assert decide(settings, state, NAN, NAN) == ("nonfinite_loss", state)
    assert decide(settings, state, 1.0, -INF) == ("nonfinite_grad_norm", state)


def test_reasons_and_settings() -> None:
    assert SKIP_REASONS == ("nonfinite_loss", "nonfinite_grad_norm", "grad_norm_spike")  # the contract's
    assert skip_reason(True, NAN, NAN) is None  # the guard's verdict comes first
    assert skip_reason(False, INF, NAN) == "nonfinite_loss"
    assert skip_reason(False, 1.0, NAN) == "nonfinite_grad_norm"
    assert skip_reason(False, 1.0, 7.0) == "grad_norm_spike"
    assert GuardSettings.from_environ({}) == GuardSettings(3.0, 10, 100)
    assert GuardSettings.from_environ({"TRAINERD_SPIKE_FACTOR": "4.5", "TRAINERD_SPIKE_WARMUP_STEPS": "20"}) \
        == GuardSettings(4.5, 20)
    assert GuardSettings.from_environ({"TRAINERD_SPIKE_FACTOR": "inf"}).spike_factor == INF
    for environ in ({"TRAINERD_SPIKE_FACTOR": "nan"}, {"TRAINERD_SPIKE_FACTOR": "1"},
                    {"TRAINERD_SPIKE_FACTOR": "x"}, {"TRAINERD_SPIKE_WARMUP_STEPS": "0"},
                    {"TRAINERD_SPIKE_WARMUP_STEPS": "2.5"}):
        with pytest.raises(ValueError, match="TRAINERD_SPIKE_FACTOR="):
            GuardSettings.from_environ(environ)
    with pytest.raises(ValueError, match="mean_horizon must be an integer of at least 1"):
        GuardSettings(mean_horizon=0)
    with pytest.raises(ValueError, match="the world size must be at least 1"):
        mean_over_ranks(0)
