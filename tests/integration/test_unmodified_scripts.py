"""An unmodified msrun-style MindSpore script as a trainerd job (issue 11), with real agents and workers.

The script (jobs/msrun_style.py) imports nothing of trainerd: progress comes from its LossMonitor
lines, it finds its data and checkpoints through relative paths in the job's working directory, and
the cause of a failure is read from its own traceback. The job specs set no workdir: the agents'
per-job default is used.

Each contract is run here once on real MindSpore; the variants of the rules that judge a failure (an error that
follows a rank to another node, one every rank raises after progress) are decided in the simulated cluster of
tests/daemon/test_script_job_decisions.py, from the same reports.
"""

from __future__ import annotations

import math
import re
import signal
import time
from pathlib import Path

import psutil
import yaml

from tests.harness import Processes, events, node_states, processes_mentioning, status, trainerctl
from tests.integration.test_recovery import final_weights, job_of, start_trainerd, wait_for_job
from tests.ports import scheduler_port
from tests.waiting import wait_until

SCRIPT = Path(__file__).with_name("jobs") / "msrun_style.py"
LOSS_LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is (\S+)$", re.MULTILINE)
ENDED = ("COMPLETED", "FAILED")


def msrun_style_job(tmp_path: Path, *script_args: str, **extra) -> dict:
    return {
        "name": "user-script",
        "entrypoint": ["{python}", str(SCRIPT), "--output", str(tmp_path / "out"), *script_args],
        "min_nodes": 2, "max_nodes": 2,
        # Required by the job spec; the script reads neither (it batches 16 samples per rank itself).
        "global_batch": 32, "micro_batch": 16,
        "scheduler_port": scheduler_port(), "stop_grace_s": 3, "start_wait_s": 0,
        **extra,
    }


def start_two_agents(tmp_path: Path, procs: Processes, job: dict) -> str:
    address = start_trainerd(tmp_path, procs, job)
    for i in range(2):
        procs.agent(f"n{i}", address)
    return address


def script_line(text: str) -> int:
    """The line number of the script's line containing `text` (where its tracebacks point)."""
    return next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if text in line)


def watch_job(address: str, what: str, until, timeout: float, procs: Processes) -> list[dict]:
    """Every job status seen until `until(job)` holds; the last one is the one that satisfied it."""
    seen: list[dict] = []

    def probe() -> bool:
        job = job_of(address)
        if job is not None:
            seen.append(job)
        return job is not None and bool(until(job))

    wait_until(probe, timeout, what, interval=0.5, on_timeout=procs.logs)
    return seen


def in_epoch_step(job: dict, steps_per_epoch: int) -> int | None:
    """The step within the epoch (1-based) whether the status counts steps per epoch or overall."""
    return None if job["step"] is None else (job["step"] - 1) % steps_per_epoch + 1


def worker_of_rank(tmp_path: Path, rank: int) -> psutil.Process:
    """The running MindSpore worker of `rank` (not a process it forked)."""
    def probe() -> psutil.Process | None:
        found: dict[int, tuple[psutil.Process, int]] = {}
        for proc in processes_mentioning(tmp_path / "out"):
            try:
                env, parent = proc.environ(), proc.ppid()
            except psutil.Error:
                continue
            if env.get("MS_ROLE") == "MS_WORKER" and env.get("RANK_ID") == str(rank):
                found[proc.pid] = (proc, parent)
        top = [proc for proc, parent in found.values() if parent not in found]
        return top[0] if len(top) == 1 else None

    return wait_until(probe, 30, f"the worker of rank {rank}")


def rank_log(address: str, rank: int, *args: str) -> str:
    result = trainerctl("logs", str(rank), *args, coordinator=address)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_unmodified_script_runs_on_output_progress_and_resumes_from_its_own_checkpoint_in_a_stable_workdir(
        tmp_path: Path, procs: Processes) -> None:
    hang_timeout_s, epochs, steps_per_epoch = 8.0, 7, 10
    job = msrun_style_job(tmp_path, "--epochs", str(epochs), "--steps-per-epoch", str(steps_per_epoch),
                          "--step-sleep", "0.5", hang_timeout_s=hang_timeout_s, restart={"max": 3, "backoff_s": 0.2})
    address = start_two_agents(tmp_path, procs, job)
    wait_for_job(address, "generation 1 launched", lambda j: j["generation"] == 1, 120, procs)
    launched = time.monotonic()

    # Start-up (cluster forming, the first compile) outlasts hang_timeout_s: no hang detection
    # before the script's first LossMonitor line, then steps read from its output keep it alive.
    seen = watch_job(address, "3 x hang_timeout_s of training",
                     lambda j: j["state"] in ENDED or j["restarts"] > 0
                     or (time.monotonic() - launched >= 3 * hang_timeout_s and (j["epoch"] or 0) >= 3), 240, procs)
    before_progress = [j for j in seen if j["generation"] == 1 and j["epoch"] is None]
    assert before_progress, "the job was never seen starting up"
    assert not any(j["hang_detection"] for j in before_progress), before_progress
    job = seen[-1]
    assert job["state"] == "RUNNING" and job["hang_detection"], job
    assert job["generation"] == 1 and job["restarts"] == 0 and job["crash_restarts"] == 0, job
    assert (job["step"] or 0) >= 1 and isinstance(job["loss"], float) and math.isfinite(job["loss"]), job

    # Kill rank 1 well inside an epoch (not while the ranks save the epoch's checkpoints).
    job = wait_for_job(address, "the middle of an epoch",
                       lambda j: j["state"] in ENDED or 2 <= (in_epoch_step(j, steps_per_epoch) or 0) <= 5, 60, procs)
    assert job["state"] == "RUNNING" and job["generation"] == 1, job
    killed_in_epoch = job["epoch"]
    victim = worker_of_rank(tmp_path, 1)
    workdir = Path(victim.cwd())
    victim.send_signal(signal.SIGKILL)

    # RUNNING once every rank of generation 2 reported a step (one rank's first line is not enough).
    job = wait_for_job(address, "generation 2 RUNNING on progress",
                       lambda j: j["state"] in ENDED or (j["generation"] == 2 and j["state"] == "RUNNING"), 180, procs)
    assert job["epoch"] is not None, job
    assert job["state"] == "RUNNING", job
    # The run's own step from the relaunch's first line (the agents learnt an epoch's steps in generation 1),
    # not a count from 1 in the resumed epoch: status does not go back, nor goodput count that epoch as lost.
    assert (job["epoch"] - 1) * steps_per_epoch < job["step"] <= job["epoch"] * steps_per_epoch, job
    assert Path(worker_of_rank(tmp_path, 1).cwd()) == workdir, "rank 1 runs in another directory after the restart"
    job = wait_for_job(address, "the end", lambda j: j["state"] in ENDED, 240, procs)
    assert job["state"] == "COMPLETED", job
    assert job["generation"] == 2 and job["restarts"] == 1 and job["crash_restarts"] == 1, job
    assert job["last_failure"]["cause"] == "process_exited" and job["last_failure"]["rank"] == 1
    assert job["last_failure"]["signal"] == signal.SIGKILL

    # The relative paths resolved to the same per-job directory in both generations.
    assert workdir.is_relative_to(tmp_path / "agents"), workdir
    assert (workdir / "data" / "train.npz").is_file()
    saved = sorted(p.name for p in (workdir / "ckpt" / "rank_1").glob("*.ckpt"))
    # ModelCheckpoint numbers its prefix when it finds an earlier run's files: mlp_1 is generation 2's.
    assert any(n.startswith("mlp-") for n in saved) and any(n.startswith("mlp_1-") for n in saved), saved

    resumed_after = killed_in_epoch - 1  # the last epoch both ranks finished and saved
    for rank in (0, 1):
        log = rank_log(address, rank, "--generation", "2")
        assert f"rank {rank}: resuming from ckpt/rank_{rank}/mlp-{resumed_after}_{steps_per_epoch}.ckpt " \
               f"after epoch {resumed_after}" in log, log[-3000:]
        first_step = LOSS_LINE.search(log)
        assert first_step and first_step.groups()[:2] == (str(resumed_after + 1), "1"), log[-3000:]
        assert f"rank {rank}: training finished after epoch {epochs}" in log
    final_weights(tmp_path / "out", 2)  # written, and identical on both ranks


def restart_trainerd(procs: Processes, running: str, name: str, cluster: Path, epochs: int,
                     job_name: str = "user-script") -> None:
    """Stop the coordinator `running`, set the job's name and --epochs in its cluster file, start it again
    as `name` (the agents stay up, as systemd services do)."""
    procs.by_name(running).signal(signal.SIGTERM)
    procs.by_name(running).wait(30)
    data = yaml.safe_load(cluster.read_text())
    data["job"]["name"] = job_name
    argv = data["job"]["entrypoint"]
    argv[argv.index("--epochs") + 1] = str(epochs)
    cluster.write_text(yaml.safe_dump(data))
    procs.trainerd(name, cluster)


def test_a_completed_job_runs_again_from_its_own_checkpoint_once_the_cluster_file_asks_for_more_epochs(
        tmp_path: Path, procs: Processes) -> None:
    """How an operator extends a finished run: more epochs in the cluster file, the coordinator restarted.
    Restarted with the file as it was, it runs nothing."""
    steps_per_epoch = 4
    job = msrun_style_job(tmp_path, "--epochs", "1", "--steps-per-epoch", str(steps_per_epoch))
    address = start_two_agents(tmp_path, procs, job)
    first = wait_for_job(address, "the first run", lambda j: j["state"] in ENDED, 180, procs)
    assert first["state"] == "COMPLETED" and first["generation"] == 1, first
    cluster = tmp_path / "trainerd.yaml"

    restart_trainerd(procs, "trainerd", "trainerd-same", cluster, epochs=1)
    wait_until(lambda: node_states(address) == {"n0": "READY", "n1": "READY"}, 60, "both agents back",
               on_timeout=procs.logs)
    # Its agents may be READY before the new leader has read the job.
    wait_until(lambda: "job user-script is COMPLETED: nothing to run" in procs.by_name("trainerd-same").log(), 30,
               "the new leader finding the job COMPLETED", on_timeout=procs.logs)
    again = job_of(address)
    assert again["generation"] == 1 and (again["epoch"], again["step"]) == (first["epoch"], first["step"]) == (
        1, steps_per_epoch), again  # where it ended, though no rank reports any more

    restart_trainerd(procs, "trainerd-same", "trainerd-changed", cluster, epochs=2)
    job = wait_for_job(address, "the second run", lambda j: j["generation"] == 2 and j["state"] in ENDED, 180, procs)
    assert job["state"] == "COMPLETED" and job["crash_restarts"] == 0, job
    changed = [e for e in events(address) if e["kind"] == "job_changed"]
    assert len(changed) == 1 and "changed entrypoint of the COMPLETED job" in changed[0]["message"], changed
    for rank in (0, 1):
        log = rank_log(address, rank, "--generation", "2")
        assert f"resuming from ckpt/rank_{rank}/mlp-1_{steps_per_epoch}.ckpt after epoch 1" in log, log[-3000:]
        first_step = LOSS_LINE.search(log)
        assert first_step and first_step.groups()[:2] == ("2", "1"), log[-3000:]
        assert f"rank {rank}: training finished after epoch 2" in log

    # A new name is a new job, from scratch in a directory of its own, on agents that ran generation 2 of
    # the old one: its generation 1 is launched, and its logs are its own.
    restart_trainerd(procs, "trainerd-changed", "trainerd-renamed", cluster, epochs=1, job_name="user-script-2")
    job = wait_for_job(address, "the renamed job", lambda j: j["name"] == "user-script-2" and j["state"] in ENDED,
                       180, procs)
    assert job["state"] == "COMPLETED" and job["generation"] == 1, job
    for rank in (0, 1):
        log = rank_log(address, rank, "--generation", "1")
        assert "resuming" not in log and log.count("training finished after epoch") == 1, log[-3000:]


def test_start_up_error_on_every_rank_fails_the_job_the_second_time_without_spending_restarts(
        tmp_path: Path, procs: Processes) -> None:
    """A missing file may be a shared file system's passing fault: the first time, the job is relaunched once
    without spending the budget; the same error in the next generation fails it (a SyntaxError or an
    ImportError of the job's own code fails it at once: tests/daemon/test_script_job_decisions.py)."""
    job = msrun_style_job(tmp_path, "--raise-at-startup", restart={"max": 3, "backoff_s": 0.2})
    address = start_two_agents(tmp_path, procs, job)
    job = wait_for_job(address, "the end", lambda j: j["state"] in ENDED, 120, procs)
    assert job["state"] == "FAILED", job
    assert job["generation"] == 2 and job["crash_restarts"] == 0, job
    failure = job["last_failure"]
    assert "FileNotFoundError: [Errno 2] No such file or directory: 'config/train.json'" in failure["message"], failure
    opened_at = script_line('open("config/train.json")')
    assert failure["location"].endswith(f"msrun_style.py:{opened_at}"), failure
    assert not any(node["quarantined"] for node in status(address)["nodes"])
    kinds = [e["kind"] for e in events(address)]
    assert kinds.count("generation_started") == 2 and kinds.count("recovery_started") == 1, kinds
    recovery = next(e for e in events(address) if e["kind"] == "recovery_started")
    assert "relaunching once without spending the restart budget" in recovery["message"], recovery
    shown = trainerctl("status", coordinator=address)
    assert "FileNotFoundError: [Errno 2] No such file or directory: 'config/train.json'" in shown.stdout


def failed_raising_at_step_7(tmp_path: Path, procs: Processes, rank: int, restart: dict,
                             timeout_s: float) -> tuple[str, dict]:
    """msrun_style.py on two agents, 3 epochs of 5 steps, whose `rank` (-1: every rank) raises ValueError at
    global step 7: the coordinator's address and the job, once FAILED (asserted)."""
    job = msrun_style_job(tmp_path, "--epochs", "3", "--steps-per-epoch", "5", "--raise-at-step", "7",
                          "--raise-rank", str(rank), restart=restart)
    address = start_two_agents(tmp_path, procs, job)
    ended = wait_for_job(address, "the end", lambda j: j["state"] in ENDED, timeout_s, procs)
    assert ended["state"] == "FAILED", ended
    return address, ended


def test_one_ranks_own_error_is_the_root_cause_not_the_collective_errors_of_the_others(
        tmp_path: Path, procs: Processes) -> None:
    address, job = failed_raising_at_step_7(tmp_path, procs, 1, {"max": 0}, 180)
    # An error after progress was seen is no start-up error: it spends the (empty) budget.
    assert job["generation"] == 1 and job["crash_restarts"] == 1, job
    started = next(e for e in events(address) if e["kind"] == "generation_started")
    failure = job["last_failure"]
    assert failure["rank"] == 1 and failure["node"] == started["fields"]["nodes"][1], failure
    assert "ValueError: bad value at step 7" in failure["message"], failure
    assert "RuntimeError" not in failure["message"] and "DISTRIBUTED" not in failure["message"], failure
    raised_at = script_line("raise ValueError(")
    assert failure["location"].endswith(f"msrun_style.py:{raised_at}"), failure
    failed = next(e for e in events(address) if e["kind"] == "job_failed")
    assert "ValueError: bad value at step 7" in failed["message"], failed


def test_trainerctl_logs_shows_a_ranks_output_from_a_running_and_from_a_finished_generation(
        tmp_path: Path, procs: Processes) -> None:
    epochs, steps_per_epoch = 3, 10
    job = msrun_style_job(tmp_path, "--epochs", str(epochs), "--steps-per-epoch", str(steps_per_epoch),
                          "--step-sleep", "0.3")
    address = start_two_agents(tmp_path, procs, job)
    job = wait_for_job(address, "epoch 2 running", lambda j: j["state"] in ENDED or (
        j["state"] == "RUNNING" and (j["epoch"] or 0) >= 2), 180, procs)
    assert job["state"] == "RUNNING", job

    running = rank_log(address, 1)  # rank 1 runs on n1: the coordinator fetches it from that agent
    assert "epoch: 1 step: 1, loss is " in running and "training finished" not in running, running[-3000:]
    tail = rank_log(address, 1, "--tail", "3").splitlines()
    assert 1 <= len(tail) <= 3 and any(LOSS_LINE.match(line) for line in tail), tail

    job = wait_for_job(address, "the end", lambda j: j["state"] in ENDED, 240, procs)
    assert job["state"] == "COMPLETED", job
    for rank in (0, 1):
        finished = rank_log(address, rank, "--generation", "1")
        assert len(LOSS_LINE.findall(finished)) == epochs * steps_per_epoch, finished[-3000:]
        assert f"rank {rank}: training finished after epoch {epochs}" in finished
    missing = trainerctl("logs", "5", coordinator=address)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr and missing.stderr.strip()


def test_a_frozen_worker_is_a_hang_its_stacks_are_dumped_and_the_event_names_it(
        tmp_path: Path, procs: Processes) -> None:
    """SIGSTOP rank 1 of a job that reports progress through its LossMonitor lines: after
    hang_timeout_s the coordinator stops the generation, every rank's Python stack is written into
    its log before the kill, the hang event names rank 1, and the next generation completes."""
    hang_timeout_s = 8.0
    job = msrun_style_job(tmp_path, "--epochs", "4", "--steps-per-epoch", "10", "--step-sleep", "0.3",
                          hang_timeout_s=hang_timeout_s, restart={"max": 3, "backoff_s": 0.2})
    address = start_two_agents(tmp_path, procs, job)
    watch_job(address, "progress on both ranks", lambda j: j["hang_detection"] and (j["step"] or 0) >= 3, 180, procs)
    frozen = worker_of_rank(tmp_path, 1)
    frozen.send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        job = wait_for_job(address, "the hang to be judged", lambda j: j["generation"] >= 2 or j["state"] in ENDED,
                           hang_timeout_s + 60, procs)
    finally:
        if frozen.is_running():
            frozen.send_signal(signal.SIGCONT)
    assert time.monotonic() - frozen_at >= hang_timeout_s
    [hang] = [e for e in events(address) if e["kind"] == "recovery_started"]
    assert hang["fields"]["failure"]["cause"] == "hang", hang
    assert "rank 1 on node n1 was behind" in hang["message"] and "stopped or stuck" in hang["message"], hang
    for rank, node in ((0, "n0"), (1, "n1")):
        stacks = tmp_path / "agents" / node / "generations" / "000001" / f"rank{rank}.stacks.txt"
        text = stacks.read_text()
        assert f"Python stacks of rank {rank}" in text and "msrun_style.py" in text, text[-2000:]
        assert f"==== trainerd: Python stacks of rank {rank}" in rank_log(address, rank, "--generation", "1")
    job = wait_for_job(address, "the job to end", lambda j: j["state"] in ENDED, 240, procs)
    assert job["state"] == "COMPLETED" and job["crash_restarts"] == 1, job
