"""The guarded step with real MindSpore in GRAPH mode, one process (a missing MindSpore fails these tests):
bad batches leave the weights, the optimizer and the guard untouched; good ones update bit-for-bit like an
unguarded step; the guard's state survives a checkpoint round trip, and the old guard's is refused; the cell
follows the pure rule. And the pure rule itself: a 20x spike is always caught, a 2x wobble never, and long
clean runs whose norm drifts and fluctuates are never skipped."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import astuple
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mindspore import nn

from proto.exit_codes import EXIT_CHECKPOINT_UNREADABLE
from proto.progress_datagram import BadBatchReason
from trainer.checkpoint.mindspore_io import load_numpy_into, parameters_to_numpy
from trainer.runtime.checkpointing import CheckpointUnreadable, TrainingCheckpoints
from trainer.runtime.guard import (
    ACCEPTED_STEPS,
    LOG_NORM_MEAN,
    LOG_NORM_VAR,
    NOT_FORCED,
    GuardedApplyGradients,
    StepGuard,
    attempt_input,
    mean_over_ranks,
)
from trainer.runtime.guard_policy import (
    SKIP_REASONS,
    GuardSettings,
    GuardState,
    decide,
    skip_reason,
    spike_limit,
)
from trainer.runtime.rank_context import RankCheckpointSettings, RankContext
from trainer.runtime.step_replay import AttemptKind

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
        loss_t, norm_t, accepted, _ = self.apply(attempt_input(AttemptKind.FIRST), ms.Tensor(MICRO_BATCHES, ms.float32), *losses)
        assert all(not grad_sum.asnumpy().any() for grad_sum in self.grad_sums), "the sums are cleared"
        loss, norm = float(loss_t.asnumpy()), float(norm_t.asnumpy())
        return loss, norm, skip_reason(bool(accepted.asnumpy()), loss, norm)

    def state(self) -> dict[str, bytes]:
        cells = [self.net, self.optimizer] + ([self.guard] if self.guard is not None else [])
        return {name: array.tobytes() for name, array in parameters_to_numpy(*cells).items()}

    def guard_state(self) -> GuardState:
        assert self.guard is not None
        return guard_state(self.guard)


def guard_state(guard: StepGuard) -> GuardState:
    return guard.state()


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


def test_a_spike_after_warmup_is_skipped_and_leaves_the_running_statistics() -> None:
    rig, rng = Rig(GuardSettings(warmup_steps=3)), np.random.default_rng(2)
    rig.step(gradients(rng))
    assert rig.step(gradients(rng, scale=10))[2] is None  # a spike within the warm-up is accepted
    rig.step(gradients(rng))
    guard = rig.guard_state()
    before = rig.state()
    _, norm, reason = rig.step(gradients(rng, scale=200))
    assert reason == "grad_norm_spike" and norm > 10 * math.exp(guard.log_norm_mean)
    assert rig.state() == before and rig.guard_state() == guard
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
    settings = GuardSettings(spike_factor=2.0, spike_zscore=1.5, warmup_steps=2, mean_horizon=3)
    original, rng = Rig(settings), np.random.default_rng(5)
    for scale in (1.0, 1.5, 0.5, 1.0):
        original.step(gradients(rng, scale))
    saved = {name: array.copy() for name, array in parameters_to_numpy(original.net, original.optimizer,
                                                                         original.guard).items()}
    assert saved[ACCEPTED_STEPS].dtype == np.int32 and saved[ACCEPTED_STEPS] == 4
    assert saved[LOG_NORM_MEAN].dtype == saved[LOG_NORM_VAR].dtype == np.float32
    assert saved[LOG_NORM_MEAN] > 0 and saved[LOG_NORM_VAR] > 0

    restored = Rig(settings)
    assert restored.state() != original.state()
    load_numpy_into(saved, restored.net, restored.optimizer, restored.guard)
    assert restored.state() == original.state()
    reasons = []
    for scale in (1.0, 2.5, 1.2, 4.0, 0.8, 30.0):  # spikes judged against the restored statistics
        grads = gradients(rng, scale)
        result = restored.step(grads)
        assert result == original.step(grads)
        reasons.append(result[2])
    assert restored.state() == original.state()
    assert "grad_norm_spike" in reasons and None in reasons


class _OldGuard(nn.Cell):
    """The state the guard before the z-score rule kept, under its names."""

    def __init__(self) -> None:
        super().__init__(auto_prefix=False)
        self.norm_mean = ms.Parameter(ms.Tensor(4.5, ms.float32), name="guard.norm_mean", requires_grad=False)
        self.accepted_steps = ms.Parameter(ms.Tensor(40, ms.int32), name="guard.accepted_steps", requires_grad=False)


class _Reporter:
    def checkpoint(self, step: int, consumed_samples: int, path: str) -> None:
        pass

    def add_checkpoint_stall(self, seconds: float) -> None:
        pass


def test_a_checkpoint_of_the_old_guard_is_refused_in_one_line(tmp_path: Path) -> None:
    ctx = RankContext.from_environ({"TRAINERD_JOB": "unit"})
    old = Rig(None)
    old.step(gradients(np.random.default_rng(8)))  # weights unlike a fresh Rig's
    with TrainingCheckpoints(ctx, RankCheckpointSettings(directory=tmp_path, every=1), _Reporter(),  # type: ignore[arg-type]
                             (old.net, old.optimizer, _OldGuard()), data_seed=0, grad_accumulation=1) as ckpt:
        ckpt.resume()
        ckpt.after_step(1, 64)
    step_1 = tmp_path / "step_00000001"
    assert step_1.is_dir()

    def resume(*cells: nn.Cell) -> None:
        settings = RankCheckpointSettings(directory=tmp_path, resume_from=step_1)
        with TrainingCheckpoints(ctx, settings, _Reporter(), cells, data_seed=0,  # type: ignore[arg-type]
                                 grad_accumulation=1) as ckpt:
            ckpt.resume()

    new = Rig(GuardSettings())
    fresh = new.state()
    with pytest.raises(CheckpointUnreadable) as refused:
        resume(new.net, new.optimizer, new.guard)
    message = str(refused.value)
    assert refused.value.exit_code == EXIT_CHECKPOINT_UNREADABLE and "\n" not in message
    assert message.startswith(f"cannot resume from checkpoint {step_1}: it holds the bad-batch guard state of an "
                              "older trainerd (guard.norm_mean)")
    assert new.state() == fresh  # nothing was loaded
    resume(new.net, new.optimizer)  # without a guard, the old guard's state is just not read
    assert new.state() == {**old.state(), **{name: value for name, value in new.state().items()
                                             if name.startswith("guard.")}}


class _GuardOnly(nn.Cell):
    def __init__(self, guard: StepGuard) -> None:
        super().__init__(auto_prefix=False)
        self.guard = guard

    def construct(self, loss: ms.Tensor, norm: ms.Tensor, force: ms.Tensor) -> ms.Tensor:
        return self.guard(loss, norm, force)


def assert_same_state(cell: _GuardOnly, state: GuardState, where: str) -> None:
    """The log is the one operation the twins do not share bit for bit (guard_policy's docstring)."""
    ours = guard_state(cell.guard)
    assert ours.accepted_steps == state.accepted_steps, where
    np.testing.assert_allclose([ours.log_norm_mean, ours.log_norm_var, ours.log_loss_mean, ours.log_loss_var],
                               [state.log_norm_mean, state.log_norm_var, state.log_loss_mean, state.log_loss_var],
                               rtol=2e-6, atol=1e-7, err_msg=where)


def follow(settings: GuardSettings, norms: list[float],
           losses: list[float] | None = None) -> list[BadBatchReason | None]:
    """Runs the cell and the pure rule side by side over the norms; asserts they agree step by step."""
    cell, state = _GuardOnly(StepGuard(settings)), GuardState()
    reasons = []
    for i, norm in enumerate(norms):
        loss = 0.5 if losses is None else losses[i]
        reason, state = decide(settings, state, loss, norm)
        accepted = bool(cell(ms.Tensor(loss, ms.float32), ms.Tensor(norm, ms.float32), NOT_FORCED).asnumpy())
        where = f"step {i}: loss {loss} norm {norm}"
        assert skip_reason(accepted, loss, norm) == reason, where
        assert_same_state(cell, state, where)
        reasons.append(reason)
    return reasons


def test_the_cell_follows_the_pure_rule_over_a_long_random_run() -> None:
    """Drifting, noisy norms with NaN, infinite and zero ones, 20x spikes and 2x wobbles mixed in."""
    settings = GuardSettings(warmup_steps=4, mean_horizon=50, spike_ceiling=12.0)
    rng = np.random.default_rng(6)
    steps = 1500
    clean_level = np.geomspace(3.0, 0.03, steps)
    level = clean_level * rng.lognormal(0.0, 0.3, steps)
    norms, losses, spikes, wobbles = [], [], [], []
    for i in range(steps):
        norm = float(level[i])
        if i % 37 == 20:
            norm = 20.0 * float(clean_level[i])
            spikes.append(i)
        elif i % 41 == 30:
            norm *= 2.0
            wobbles.append(i)
        elif i % 53 == 9:
            norm = float(rng.choice([NAN, INF, -INF, 0.0]))
        norms.append(norm)
        losses.append(float(rng.choice([NAN, INF, -INF])) if i % 61 == 5 else float(rng.random()))
    reasons = follow(settings, norms, losses)
    assert set(reasons) == {None, *SKIP_REASONS}
    assert all(reasons[i] in ("grad_norm_spike", "nonfinite_loss") for i in spikes)
    assert all(reasons[i] in (None, "nonfinite_loss") for i in wobbles)


def test_the_cell_follows_the_pure_rule_at_the_edges() -> None:
    """A steady norm: 2.9 times it passes, 3.1 times is a spike (a floor of 3, when the spread is 0), and
    11.9 and 12.1 times by default (the floor is the ceiling); a noisy
    norm: 9 times its mean passes, 11 times is a spike (the ceiling); an infinite factor turns spikes off;
    a zero norm is accepted and pulls the mean down by log(ceiling) / weight at most, so the next normal norm
    passes; the largest float32 norm is judged like any other."""
    biggest = float(np.finfo(np.float32).max)
    steady = GuardSettings(spike_factor=3.0, warmup_steps=3)
    assert follow(steady, [2.0, 2.0, 2.0, 5.8]) == [None] * 4
    assert follow(steady, [2.0, 2.0, 2.0, 6.2]) == [None] * 3 + ["grad_norm_spike"]
    default = GuardSettings(warmup_steps=3, spike_ceiling=12.0)  # spike_factor = spike_ceiling = 12
    assert follow(default, [2.0, 2.0, 2.0, 23.8]) == [None] * 4
    assert follow(default, [2.0, 2.0, 2.0, 24.2]) == [None] * 3 + ["grad_norm_spike"]
    noisy = GuardSettings(spike_factor=3.0, spike_ceiling=10.0, warmup_steps=4, mean_horizon=4)  # log-norm mean 0, deviation 1.6
    assert follow(noisy, [1.0, 0.1, 10.0, 1.0, 9.0]) == [None] * 5
    assert follow(noisy, [1.0, 0.1, 10.0, 1.0, 11.0]) == [None] * 4 + ["grad_norm_spike"]
    off = GuardSettings(spike_factor=INF, warmup_steps=1)
    assert follow(off, [1.0, 1e30, biggest, INF, NAN]) == [None, None, None, "nonfinite_grad_norm",
                                                            "nonfinite_grad_norm"]
    zero = GuardSettings(warmup_steps=2, mean_horizon=4)
    assert follow(zero, [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]) == [None] * 6
    assert follow(GuardSettings(warmup_steps=1), [biggest, biggest, INF, 1.0]) == [None, None, "nonfinite_grad_norm",
                                                                                  None]


def test_the_pure_rule() -> None:
    settings = GuardSettings(spike_factor=3.0, spike_zscore=2.0, spike_ceiling=10.0, warmup_steps=2, mean_horizon=2)
    reason, state = decide(settings, GuardState(), 1.0, 1.0)
    assert (reason, state) == (None, GuardState(0.0, 0.0, 1, 0.0, 0.0))  # log 1 = 0
    reason, state = decide(settings, state, 1.0, math.exp(2.0))  # no spike check in the warm-up
    assert reason is None and astuple(state)[:3] == (pytest.approx(1.0), pytest.approx(1.0), 2)  # of 0 and 2
    assert decide(settings, state, 1.0, math.exp(1.0 + 2.01)) == ("grad_norm_spike", state)  # 2.01 > 2 × 1
    reason, state = decide(settings, state, 1.0, math.exp(1.0 + 1.99))  # then EMAs with weight 1/2
    assert reason is None and astuple(state)[:3] == (pytest.approx(1.995), pytest.approx(1.490025), 3)
    assert decide(settings, state, NAN, NAN) == ("nonfinite_loss", state)
    assert decide(settings, state, 1.0, -INF) == ("nonfinite_grad_norm", state)
    spread = GuardState(0.0, 4.0, 10)  # 2 standard deviations are 4 > log 10: the ceiling holds
    assert decide(settings, spread, 1.0, 9.9)[0] is None and decide(settings, spread, 1.0, 10.1)[0] == "grad_norm_spike"
    steady = GuardState(0.0, 0.0, 10)  # no spread: the floor holds
    assert decide(settings, steady, 1.0, 2.99)[0] is None and decide(settings, steady, 1.0, 3.01)[0] == "grad_norm_spike"
    reason, state = decide(settings, steady, 1.0, 0.0)  # held to log(10) below the mean
    assert reason is None and state.log_norm_mean == pytest.approx(-math.log(10) / 2)
    assert spike_limit(GuardSettings(spike_factor=INF), 1.0) == INF


STATES = st.builds(GuardState, st.floats(-30.0, 30.0), st.floats(0.0, 25.0), st.integers(10, 10**6))


@settings(max_examples=300, deadline=None)
@given(STATES)
def test_a_spike_above_the_ceiling_is_always_suspect_and_a_2x_wobble_never(state: GuardState) -> None:
    """Against the running geometric mean, whatever the spread and the history."""
    mean = math.exp(state.log_norm_mean)
    assert decide(GuardSettings(), state, 1.0, 60.0 * mean)[0] == "grad_norm_spike"
    assert decide(GuardSettings(spike_ceiling=12.0), state, 1.0, 20.0 * mean)[0] == "grad_norm_spike"
    assert decide(GuardSettings(), state, 1.0, 2.0 * mean)[0] is None


CEILING_12 = GuardSettings(spike_ceiling=12.0)  # the ceiling when a suspect step was skipped outright
SENSITIVE = GuardSettings(spike_factor=3.0, spike_ceiling=12.0)  # what a job whose norm is steadier may choose


@settings(max_examples=4, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1))
def test_a_long_clean_run_is_never_skipped_and_its_spikes_always_are(seed: int) -> None:
    """20,000 steps whose norm shrinks 10x over training, with ±50% noise on every step (and some 2x
    wobbles), then the same run with 20x spikes at random steps: nothing but the spikes is skipped, by the
    default rule and by the sensitive one (spike_factor 3, the z-score deciding between 3 and 12)."""
    rng = np.random.default_rng(seed)
    steps = 20_000
    clean = np.geomspace(5.0, 0.5, steps) * rng.uniform(0.5, 1.5, steps)
    clean[rng.choice(steps, 50, replace=False)] *= 2.0
    spikes = set(rng.choice(np.arange(100, steps), 20, replace=False).tolist())
    spiked = [20.0 * np.geomspace(5.0, 0.5, steps)[i] if i in spikes else norm for i, norm in enumerate(clean)]
    for rule, norms, expected in ((rule, norms, expected) for rule in (CEILING_12, SENSITIVE)
                                  for norms, expected in ((clean, set()), (spiked, spikes))):
        state, skipped = GuardState(), set()
        for i, norm in enumerate(norms):
            reason, state = decide(rule, state, 1.0, float(norm))
            if reason is not None:
                skipped.add(i)
        assert skipped == expected


@settings(max_examples=3, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1))
def test_late_training_fluctuation_is_not_a_spike(seed: int) -> None:
    """Even the sensitive rule adapts to a small late-training norm whose relative fluctuation is large
    (log-normal, sigma 0.4: 3 times the running mean about once in 600 steps, which a fixed 3x skipped)."""
    rng = np.random.default_rng(seed)
    state = GuardState()
    for norm in np.geomspace(1.0, 1e-4, 20_000) * rng.lognormal(0.0, 0.4, 20_000):
        reason, state = decide(SENSITIVE, state, 1.0, float(norm))
        assert reason is None, f"{norm} skipped with {state}"


RECORDED_NORMS = Path(__file__).parent / "data" / "transformer_lm_3_ranks_norms.txt"


def test_a_real_runs_clean_instability_is_not_a_spike() -> None:
    """The Transformer example's own gradient norms at 3 ranks: around step 764 its clean training wobbles
    (norms 0.78, 1.20, 1.05 against a running geometric mean of 0.30, loss unchanged). Not a bad batch:
    the next, different batch was as high. The defaults before (floor 3, z-score 6) skipped step 764 for good."""
    rows = np.loadtxt(RECORDED_NORMS, comments="#")
    assert rows.shape == (2400, 3) and np.array_equal(rows[:, 0], np.arange(1, 2401))

    def skipped(settings: GuardSettings) -> list[int]:
        state, steps = GuardState(), []
        for step, loss, norm in rows:
            reason, state = decide(settings, state, float(loss), float(norm))
            if reason is not None:
                steps.append(int(step))
        return steps

    assert skipped(GuardSettings()) == []
    assert skipped(SENSITIVE) == []
    assert skipped(GuardSettings(spike_factor=3.0, spike_zscore=6.0)) == [764]  # the defaults before


def test_reasons_and_settings() -> None:
    assert SKIP_REASONS == ("nonfinite_loss", "nonfinite_grad_norm", "grad_norm_spike")  # the contract's
    assert skip_reason(True, NAN, NAN) is None  # the guard's verdict comes first
    assert skip_reason(False, INF, NAN) == "nonfinite_loss"
    assert skip_reason(False, 1.0, NAN) == "nonfinite_grad_norm"
    assert skip_reason(False, 1.0, 7.0) == "grad_norm_spike"
    assert GuardSettings.from_environ({}) == GuardSettings(12.0, 8.0, 50.0, 10, 100)
    assert GuardSettings.from_environ({"TRAINERD_SPIKE_FACTOR": "4.5", "TRAINERD_SPIKE_WARMUP_STEPS": "20",
                                       "TRAINERD_SPIKE_ZSCORE": "7", "TRAINERD_SPIKE_CEILING": "25.5",
                                       "TRAINERD_SPIKE_OTHER": "x"}) \
        == GuardSettings(4.5, 7.0, 25.5, 20)
    assert GuardSettings.from_environ({"TRAINERD_SPIKE_FACTOR": "inf", "TRAINERD_SPIKE_ZSCORE": ""}) \
        == GuardSettings(spike_factor=INF)
    for environ, message in [
        ({"TRAINERD_SPIKE_FACTOR": "nan"}, "spike_factor must be a number above 1, not nan"),
        ({"TRAINERD_SPIKE_FACTOR": "1"}, "spike_factor must be a number above 1"),
        ({"TRAINERD_SPIKE_FACTOR": "x"}, "could not convert"),
        ({"TRAINERD_SPIKE_ZSCORE": "inf"}, "spike_zscore must be a finite number above 0"),
        ({"TRAINERD_SPIKE_ZSCORE": "0"}, "spike_zscore must be a finite number above 0"),
        ({"TRAINERD_SPIKE_CEILING": "inf"}, "spike_ceiling must be a finite number above 1"),
        ({"TRAINERD_SPIKE_WARMUP_STEPS": "0"}, "warmup_steps must be an integer of at least 1"),
        ({"TRAINERD_SPIKE_WARMUP_STEPS": "2.5"}, "invalid literal for int"),
    ]:
        shown = " ".join(f"{name}={value!r}" for name, value in environ.items())
        with pytest.raises(ValueError, match=f"^{shown}: .*{message}"):  # an empty variable is not shown
            GuardSettings.from_environ({"TRAINERD_SPIKE_CEILING": "", **environ})
    with pytest.raises(ValueError, match="mean_horizon must be an integer of at least 1"):
        GuardSettings(mean_horizon=0)
    with pytest.raises(ValueError, match="the world size must be at least 1"):
        mean_over_ranks(0)
