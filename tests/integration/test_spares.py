"""Hot spares with real processes: trainerd, three agents, real MindSpore workers on the CPU. With
job.spare_nodes 1 the job runs on two of the three nodes; the third stands by and `trainerctl status` lists
it. When a running node is lost (its agent and everything it started killed), the next generation takes
the spare in its place at the same world size, and the final weights equal a run without the fault, bit
for bit: no reshard, the same batch split."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import numpy as np
import psutil

from tests.harness import Processes, events, trainerctl
from tests.integration.test_recovery import final_weights, recovery_job, start_trainerd, wait_for_job
from tests.waiting import wait_until

FORKED_FROM = re.compile(r"warm \(forked from the pre-started interpreter pid (\d+)\)")
STEPS = 450  # the steps at least 12 ms apart (the floor): the fault lands mid-run on an idle machine too
EVERY = 100


def test_a_lost_node_is_replaced_by_the_spare_at_the_same_world_size_to_the_same_weights(
        tmp_path: Path, procs: Processes) -> None:
    results = {}
    for run, nodes, spare_nodes in (("reference", 2, 0), ("spared", 3, 1)):
        run_dir = tmp_path / run
        run_dir.mkdir()
        # min_nodes 2: the job starts once two nodes are in, the third stands by whenever it comes (start_wait_s 0)
        job = recovery_job(run_dir, steps=STEPS, nodes=(2, nodes), global_batch=64, micro_batch=16, every=EVERY,
                           spare_nodes=spare_nodes, restart={"backoff_s": 0}, min_step_ms=12)
        address = start_trainerd(run_dir, procs, job, name=f"trainerd-{run}")
        for i in range(nodes):
            procs.agent(f"{run}-{i}", address)
        if run == "spared":
            running = wait_for_job(address, "a checkpoint, then steps, with a spare", lambda j: j["state"] == "RUNNING"
                                   and (j["last_checkpoint_step"] or 0) >= EVERY and j["spares"], 240, procs)
            assert running["step"] < STEPS - 200, f"too fast to test: step {running['step']} already"
            # the two nodes in first run the job (min_nodes 2), the third stands by, its warm template started
            (spare,) = running["spares"]
            assert running["world_size"] == 2 and spare not in {r["node"] for r in running["ranks"]}, running
            assert f"spares: {spare}" in trainerctl("status", coordinator=address).stdout
            spare_log = procs.by_name(spare).log
            standing_by = f"standing by for generation {running['generation']} of job mlp"
            wait_until(lambda log=spare_log, line=standing_by: line in log(), 60, "the spare standing by",
                       on_timeout=procs.logs)
            standing_templates = {p.pid for p in psutil.Process(procs.by_name(spare).pid).children()
                                  if "agent.warm_worker" in " ".join(p.cmdline())}
            assert standing_templates, "the spare started no warm template while standing by"
            # The node of rank 1 dies with everything it started.
            victim_name = next(r["node"] for r in running["ranks"] if r["rank"] == 1)
            victim = procs.by_name(victim_name)
            started = psutil.Process(victim.pid).children(recursive=True)
            victim.signal(signal.SIGKILL)
            for process in started:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
            first = running["generation"]
            relaunched = wait_for_job(address, "the next generation running",
                                      lambda j, first=first: j["generation"] > first and j["state"] == "RUNNING",
                                      120, procs)
            assert relaunched["world_size"] == 2 and relaunched["last_failure"]["cause"] == "node_lost"
            assert {r["node"] for r in relaunched["ranks"]} == {"spared-0", "spared-1", "spared-2"} - {victim_name}
            assert relaunched["spares"] == [] and relaunched["crash_restarts"] == 0
            # The spare's worker was forked from the template it started while standing by: nothing cold.
            forked_from = wait_until(lambda log=spare_log: [int(pid) for pid in FORKED_FROM.findall(log())], 60,
                                     "the spare's worker started", on_timeout=procs.logs)
            assert set(forked_from) <= standing_templates and " cold (" not in spare_log(), spare_log()[-3000:]
        job = wait_for_job(address, "the end", lambda j: j["state"] in ("COMPLETED", "FAILED"), 300, procs)
        assert job["state"] == "COMPLETED" and job["step"] == STEPS, job
        results[run] = (job, final_weights(run_dir / "out", 2))

    job, weights = results["spared"]
    assert job["generation"] == 2 and job["world_size"] == 2
    started = [e for e in events(address) if e["kind"] == "generation_started"]
    assert "world size 2" in started[-1]["message"], started[-1]
    reference = results["reference"][1]
    assert sorted(weights) == sorted(reference)
    for name in reference:
        assert np.array_equal(weights[name], reference[name]), f"{name} differs from the run without the fault"
