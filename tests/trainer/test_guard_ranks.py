"""The guarded step on two real MindSpore workers (and their scheduler), launched without msrun: a bad
batch on one rank only (a NaN loss, an infinite gradient, a 20x gradient spike) makes every rank skip the
same step, so their weights stay identical. A missing MindSpore fails this test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.harness import Processes
from tests.ports import free_port

pytestmark = pytest.mark.mindspore  # MindSpore processes: left out of `make test-fast`

WORLD_SIZE = 2
STEPS = 9
REPO = Path(__file__).resolve().parents[2]

WORKER = """
import json, sys
import numpy as np
from trainer.runtime import communication
from trainer.runtime.rank_context import RankContext

ctx = RankContext.from_environ()
communication.initialize(ctx, "CPU")  # the scheduler stays in here
import mindspore as ms
from mindspore import nn
from trainer.runtime.guard import GuardedApplyGradients, StepGuard, attempt_input, mean_over_ranks
from trainer.runtime.step_replay import AttemptKind
from trainer.runtime.guard_policy import GuardSettings, skip_reason

ms.set_seed(0)
net = nn.Dense(6, 4)
optimizer = nn.Adam(net.trainable_params(), learning_rate=0.05)
grad_sums = optimizer.parameters.clone(prefix="grad_sum", init="zeros")
guard = StepGuard(GuardSettings(warmup_steps=2))
apply = GuardedApplyGradients(optimizer, grad_sums, communication.gradient_reducer(ctx, optimizer.parameters),
                              mean_over_ranks(ctx.world_size), guard, max_grad_norm=5.0)
rng = np.random.default_rng(100 + ctx.rank)  # each rank its own gradients
bad = {3: (1, "nan loss"), 5: (0, "spike"), 7: (1, "inf grad")}  # step -> the one rank whose batch is bad
results = []
for step in range(1, STEPS + 1):
    # 28 times one rank's gradients make the global (mean) gradient's norm about 20 times the usual
    scale = 28.0 if bad.get(step) == (ctx.rank, "spike") else 1.0
    for grad_sum in grad_sums:
        grad_sum.set_data(ms.Tensor((rng.standard_normal(grad_sum.shape) * scale).astype(np.float32)))
    if bad.get(step) == (ctx.rank, "inf grad"):
        grad_sums[0].set_data(ms.Tensor(np.full(grad_sums[0].shape, np.inf, np.float32)))
    loss = float("nan") if bad.get(step) == (ctx.rank, "nan loss") else 1.0 + ctx.rank
    loss, norm, accepted, _ = apply(attempt_input(AttemptKind.FIRST), ms.Tensor(1.0, ms.float32), ms.Tensor(loss, ms.float32))
    loss, norm = float(loss.asnumpy()), float(norm.asnumpy())
    results.append([loss, norm, skip_reason(bool(accepted.asnumpy()), loss, norm)])
with open(f"{sys.argv[1]}/rank{ctx.rank}.json", "w") as f:
    json.dump({"results": results, "accepted_steps": int(guard.accepted_steps.asnumpy()),
               "weights": {p.name: p.asnumpy().tolist() for p in net.trainable_params()}}, f)
""".replace("STEPS", str(STEPS))


def test_every_rank_skips_a_batch_that_is_bad_on_one_rank(tmp_path: Path) -> None:
    script = tmp_path / "guarded_worker.py"
    script.write_text(WORKER)
    common = {"MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(free_port()), "MS_WORKER_NUM": str(WORLD_SIZE),
              "RANK_SIZE": str(WORLD_SIZE), "TRAINERD_JOB": "guard", "TRAINERD_GENERATION": "1", "GLOG_v": "3",
              "MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1", "PYTHONPATH": str(REPO)}
    envs = {"scheduler": common | {"MS_ROLE": "MS_SCHED", "RANK_ID": "0", "TRAINERD_LOCAL_RANK": "-1"}}
    for rank in range(WORLD_SIZE):
        envs[f"rank{rank}"] = common | {"MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(rank), "RANK_ID": str(rank),
                                        "DEVICE_ID": str(rank), "TRAINERD_LOCAL_RANK": str(rank)}
    processes = Processes(tmp_path)
    try:
        procs = {name: processes.start(name, [sys.executable, str(script), str(tmp_path)], env)
                 for name, env in envs.items()}
        for name, proc in procs.items():
            assert proc.wait(timeout=90) == 0, f"{name} failed:\n{proc.log()[-3000:]}"
    finally:
        processes.cleanup()

    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    assert ranks[0]["results"] == ranks[1]["results"]  # the same loss, norm and decision on every rank
    reasons = [reason for _, _, reason in ranks[0]["results"]]
    assert reasons == [None, None, "nonfinite_loss", None, "grad_norm_spike", None, "nonfinite_grad_norm", None, None]
    losses = [loss for loss, _, _ in ranks[0]["results"]]
    assert losses[2] != losses[2] and all(loss == 1.5 for i, loss in enumerate(losses) if i != 2)  # mean of 1, 2
    norms = [norm for _, norm, _ in ranks[0]["results"]]
    assert norms[6] == float("inf") and 10 < norms[4] / max(norms[:4]) < 40
    assert ranks[0]["accepted_steps"] == ranks[1]["accepted_steps"] == STEPS - 3
    assert ranks[0]["weights"] == ranks[1]["weights"]
