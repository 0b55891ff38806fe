"""The Transformer example (trainer/examples/transformer_lm.py: Model.train, TrainerdCallback, the guarded cell,
the elastic dataset) under real trainerd, agents and MindSpore workers: a killed worker recovers to the final
weights of a run without the fault, bit for bit; and in one run on three nodes, status shows step, loss and
gradient norm while it runs, an injected NaN batch is skipped on every rank and lands in the ledger, and a lost
node shrinks the job to two ranks, resumed resharded from a checkpoint, which then completes."""

from __future__ import annotations

import math
import re
import signal
from pathlib import Path

import numpy as np
import psutil

from tests.harness import Processes, events, processes_mentioning
from tests.integration.test_bad_batches import ledger
from tests.integration.test_recovery import final_weights, recovery_job, start_trainerd, wait_for_job

GLOBAL_BATCH = 48
EVERY = 10


def transformer_job(run_dir: Path, steps: int, nodes: tuple[int, int], micro_batch: int, *flags: str,
                    **extra) -> dict:
    entrypoint = ["{python}", "-m", "trainer.examples.transformer_lm", "--steps", str(steps), "--steps-per-epoch",
                  "30", "--warmup-steps", "20", "--log-every", "10", "--output", str(run_dir / "out"), *flags]
    return recovery_job(run_dir, steps=steps, nodes=nodes, global_batch=GLOBAL_BATCH, micro_batch=micro_batch,
                        every=EVERY, entrypoint=entrypoint, **extra)


def rank_worker(run_dir: Path, rank: int) -> psutil.Process:
    return next(p for p in processes_mentioning(run_dir / "out")
                if p.environ().get("RANK_ID") == str(rank) and p.environ().get("MS_ROLE") == "MS_WORKER")


def test_a_killed_worker_recovers_to_the_weights_of_a_run_without_the_fault(tmp_path: Path, procs: Processes) -> None:
    results = {}
    for run_dir in (tmp_path / "reference", tmp_path / "faulty"):
        run_dir.mkdir()
        address = start_trainerd(run_dir, procs, transformer_job(run_dir, 60, (2, 2), GLOBAL_BATCH // 2),
                                 name=f"trainerd-{run_dir.name}")
        for i in range(2):
            procs.agent(f"{run_dir.name}-{i}", address)
        if run_dir.name == "faulty":
            wait_for_job(address, "a checkpoint", lambda j: (j["last_checkpoint_step"] or 0) >= 2 * EVERY, 240, procs)
            rank_worker(run_dir, 1).send_signal(signal.SIGKILL)
        job = wait_for_job(address, "the end", lambda j: j["state"] in ("COMPLETED", "FAILED"), 300, procs)
        assert job["state"] == "COMPLETED", job
        results[run_dir.name] = (job, final_weights(run_dir / "out", 2))

    job, weights = results["faulty"]
    assert job["generation"] == 2 and job["last_failure"]["signal"] == signal.SIGKILL, job
    assert job["last_recovery"]["resumed_from_step"] >= 2 * EVERY, job
    reference = results["reference"][1]
    assert sorted(weights) == sorted(reference)
    for name in reference:
        assert np.array_equal(weights[name], reference[name]), f"{name} differs from the run without the fault"


def test_nan_batch_skipped_on_every_rank_and_a_lost_node_shrinks_the_job_to_a_resharded_resume(
        tmp_path: Path, procs: Processes) -> None:
    steps, nan_step = 90, 15
    nan = ((nan_step - 1) * GLOBAL_BATCH, nan_step * GLOBAL_BATCH)
    job = transformer_job(tmp_path, steps, (2, 3), 8, "--bad-samples", "%d:%d" % nan, start_wait_s=120)
    address = start_trainerd(tmp_path, procs, job)
    for i in range(3):
        procs.agent(f"n{i}", address)

    shown: dict[int, list[dict]] = {}  # generation -> the running job as status showed it

    def seen(job: dict) -> dict:
        if job["state"] == "RUNNING" and job["step"]:
            shown.setdefault(job["generation"], []).append(job)
        return job

    wait_for_job(address, "3 ranks past the NaN batch and two checkpoints",
                 lambda j: seen(j)["world_size"] == 3 and (j["last_checkpoint_step"] or 0) >= 2 * EVERY, 240, procs)
    victims = [p for p in processes_mentioning(tmp_path / "out") if p.cwd().startswith(str(tmp_path / "agents" / "n2"))]
    assert victims, "no worker of n2 found"
    procs.by_name("n2").signal(signal.SIGKILL)  # the agent ...
    for worker in victims:  # ... and its workers: the host is gone
        worker.kill()
    job = wait_for_job(address, "generation 2 on 2 ranks running",
                       lambda j: seen(j)["generation"] == 2 and j["world_size"] == 2 and j["step"], 120, procs)
    assert job["last_failure"]["cause"] == "node_lost" and job["last_failure"]["node"] == "n2", job
    job = wait_for_job(address, "the end", lambda j: seen(j)["state"] in ("COMPLETED", "FAILED"), 300, procs)
    assert job["state"] == "COMPLETED" and job["generation"] == 2 and job["step"] == steps, job

    started = [e for e in events(address) if e["kind"] == "generation_started"]
    assert [e["fields"]["nodes"] for e in started] == [["n0", "n1", "n2"], ["n0", "n1"]]
    assert started[1]["fields"]["resume_step"] >= 2 * EVERY  # resharded 3 -> 2 from a checkpoint
    for generation in (1, 2):  # status showed the step, a finite loss and gradient norm while each generation ran
        assert shown.get(generation), f"status never showed generation {generation} running"
        # (but while a rank's newest report is the NaN batch's own step: its loss and norm are NaN, and the
        # job's loss is the mean of the ranks' newest)
        unfit = [(j["step"], j["loss"], j["grad_norm"]) for j in shown[generation]
                 if nan_step not in {r["step"] for r in j["ranks"]} and not (
                     math.isfinite(j["loss"]) and j["grad_norm"] is not None and math.isfinite(j["grad_norm"])
                     and j["grad_norm"] > 0)]
        assert not unfit, f"generation {generation}: status showed (step, loss, grad norm) {unfit[:5]}"
    assert [(e["start"], e["end"], e["step"], e["generation"]) for e in ledger(address)] == [(*nan, nan_step, 1)]
    assert ledger(address)[0]["reason"].startswith("nonfinite")
    for rank in range(3):  # every rank skipped the update itself, inside its step
        [log] = (tmp_path / "agents").glob(f"n*/generations/000001/rank{rank}.log")
        assert re.search(rf"step {nan_step} skipped as bad data \(nonfinite", log.read_text()), f"rank {rank} did not skip"
    weights = final_weights(tmp_path / "out", 2)
    assert all(np.isfinite(w).all() for w in weights.values())
