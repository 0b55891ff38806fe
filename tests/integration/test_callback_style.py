"""The callback recipe (trainer.runtime.callback) in a user's script: jobs/callback_style.py is jobs/msrun_style.py
converted, its code differs in at most five changed or added lines (each module docstring describes its own
script and is left out of the comparison), and under real trainerd, agents and MindSpore workers it saves
trainerd's checkpoints and, after a worker is killed, resumes from one inside an epoch to the same final
weights as a run without the fault."""

from __future__ import annotations

import ast
import difflib
import re
import signal
from pathlib import Path

import numpy as np

from tests.harness import Processes, events, processes_mentioning
from tests.integration.test_recovery import final_weights, start_trainerd, wait_for_job
from tests.ports import scheduler_port

JOBS = Path(__file__).with_name("jobs")
# The issue-46 script: callback_style.py that kept msrun_style.py's ModelCheckpoint (and its own resume, which
# then finds its files) beside TrainerdCallback.
KEPT_MODEL_CHECKPOINT = ("\n    callbacks = [LossMonitor(1), TimeMonitor(), TrainerdCallback(),",
                         "\n    callbacks = [LossMonitor(1), TimeMonitor(), TrainerdCallback(), "
                         "ModelCheckpoint(prefix='mlp', directory=ckpt_dir, config=config),")
MAX_CHANGED_LINES = 5
LOSS_LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is ", re.MULTILINE)


def code_lines(path: Path) -> list[str]:
    """The script's lines after its module docstring."""
    text = path.read_text()
    docstring = ast.parse(text).body[0]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant), f"{path} has no docstring"
    return text.splitlines()[docstring.end_lineno:]


def changed_lines(before: list[str], after: list[str]) -> list[str]:
    """The lines of `after` that are new or changed, as a unified diff shows them; a replaced block counts the
    longer of its two sides, so removing lines costs as much as adding them."""
    changed: list[str] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes():
        if tag != "equal":
            changed += after[j1:j2] + [""] * max(0, (i2 - i1) - (j2 - j1))
    return changed


def test_the_callback_style_script_is_the_msrun_style_script_plus_at_most_five_lines() -> None:
    changed = changed_lines(code_lines(JOBS / "msrun_style.py"), code_lines(JOBS / "callback_style.py"))
    assert len(changed) <= MAX_CHANGED_LINES, "\n".join(changed)
    recipe = "\n".join(changed)
    for name in ("TrainerdCallback()", "GuardedTrainOneStepCell(", "trainerd_dataset(", "resume_epoch(dataset)"):
        assert name in recipe, f"{name} is not among the changed lines:\n{recipe}"


def test_the_count_sees_every_kind_of_change() -> None:
    before = ["a", "b", "c", "d"]
    assert changed_lines(before, before) == []
    assert changed_lines(before, ["a", "x", "c", "d"]) == ["x"]
    assert changed_lines(before, ["a", "b", "x", "c", "d"]) == ["x"]
    assert len(changed_lines(before, ["a", "d"])) == 2
    assert len(changed_lines(before, ["a", "x", "d"])) == 2


def rank_log(procs: Processes, nodes: str, rank: int, generation: int) -> str:
    """What rank `rank` printed in `generation`, from the log its agent (one of the nodes named `nodes`-i)
    keeps in its work directory."""
    [log] = (procs.root / "agents").glob(f"{nodes}-*/generations/{generation:06d}/rank{rank}.log")
    return log.read_text()


def callback_style_job(run_dir: Path, epochs: int, steps_per_epoch: int, every: int) -> dict:
    return {
        "name": "callback-style",
        "entrypoint": ["{python}", str(JOBS / "callback_style.py"), "--output", str(run_dir / "out"),
                       "--epochs", str(epochs), "--steps-per-epoch", str(steps_per_epoch), "--step-sleep", "0.2"],
        "min_nodes": 2, "max_nodes": 2, "global_batch": 32, "micro_batch": 16,
        "scheduler_port": scheduler_port(), "stop_grace_s": 3, "start_wait_s": 0,
        # In-memory snapshots on the same steps as the disk checkpoints: with `auto` the newest could be at
        # an epoch's end (step 20 in one CI run), and the resume under test is one inside an epoch.
        "checkpoint": {"dir": str(run_dir / "checkpoints"), "every_steps": every, "keep": 3,
                       "memory_every_steps": every},
    }


def test_the_converted_script_resumes_from_trainerds_checkpoint_inside_an_epoch_to_the_same_weights(
        tmp_path: Path, procs: Processes) -> None:
    epochs, steps_per_epoch, every = 5, 10, 7  # checkpoints at steps 7, 14, ...: inside epochs
    results = {}
    for run_dir in (tmp_path / "reference", tmp_path / "faulty"):
        run_dir.mkdir()
        address = start_trainerd(run_dir, procs, callback_style_job(run_dir, epochs, steps_per_epoch, every),
                                 name=f"trainerd-{run_dir.name}")
        for i in range(2):
            procs.agent(f"{run_dir.name}-{i}", address)
        if run_dir.name == "faulty":
            running = wait_for_job(address, "a checkpoint", lambda j: (j["last_checkpoint_step"] or 0) >= 2 * every,
                                   240, procs)
            # The pace counts the 0.2 s the script sleeps after each step (after TrainerdCallback's step end):
            # at most 32 samples per 0.2 s, not the thousands the step alone would read as (the coordinator
            # places a requested checkpoint a couple of seconds of steps ahead at this pace).
            assert 0 < running["samples_per_s"] <= 32 / 0.2, running
            rank1 = next(p for p in processes_mentioning(run_dir / "out")
                         if p.environ().get("RANK_ID") == "1" and p.environ().get("MS_ROLE") == "MS_WORKER")
            rank1.send_signal(signal.SIGKILL)
        job = wait_for_job(address, "the end", lambda j: j["state"] in ("COMPLETED", "FAILED"), 300, procs)
        assert job["state"] == "COMPLETED", job
        assert job["last_checkpoint_step"] == every * (epochs * steps_per_epoch // every), job
        assert (job["epoch"], job["step"]) == (epochs, epochs * steps_per_epoch), job  # Model.train's epoch, global step
        results[run_dir.name] = (job, final_weights(run_dir / "out", 2))

    job, weights = results["faulty"]
    assert job["generation"] == 2 and job["restarts"] == 1 and job["last_failure"]["signal"] == signal.SIGKILL, job
    resumed_from = job["last_recovery"]["resumed_from_step"]
    assert resumed_from >= 2 * every and resumed_from % steps_per_epoch != 0, job  # inside an epoch
    for rank in (0, 1):
        printed = LOSS_LINE.findall(rank_log(procs, "faulty", rank, generation=2))
        assert printed[0] == (str(resumed_from // steps_per_epoch + 1), str(resumed_from % steps_per_epoch + 1))
        assert len(printed) == epochs * steps_per_epoch - resumed_from, printed
    reference = results["reference"][1]
    assert sorted(weights) == sorted(reference)
    for name in reference:
        assert np.array_equal(weights[name], reference[name]), f"{name} differs from the run without the fault"


def test_a_model_checkpoint_beside_the_callback_is_a_job_warning_at_the_first_start_and_the_recipe_none(
        tmp_path: Path, procs: Processes) -> None:
    """The risk that failed the issue's job at its first recovery, days in, is told in the first generation
    while it runs; the recipe's script, which replaced ModelCheckpoint, is not warned."""
    text = (JOBS / "callback_style.py").read_text()
    assert text.count(KEPT_MODEL_CHECKPOINT[0]) == 1
    kept = JOBS / "kept_model_checkpoint.py"  # beside the others: it imports nothing else
    kept.write_text(text.replace(*KEPT_MODEL_CHECKPOINT))
    try:
        warned = {}
        for name, script in (("kept", kept), ("recipe", JOBS / "callback_style.py")):
            run_dir = tmp_path / name
            run_dir.mkdir()
            job = callback_style_job(run_dir, epochs=3, steps_per_epoch=10, every=5)
            job["entrypoint"][1] = str(script)
            address = start_trainerd(run_dir, procs, job, name=f"trainerd-{name}")
            for i in range(2):  # short names: the agent's unix socket path is at most 107 bytes
                procs.agent(f"{name}-{i}", address)
            running = wait_for_job(address, "a checkpoint", lambda j: (j["last_checkpoint_step"] or 0) >= 5, 240,
                                   procs)
            assert running["generation"] == 1 and running["state"] == "RUNNING", running
            warned[script] = [e for e in events(address) if e["kind"] == "job_warning"]
        [warning] = warned[kept]
        assert warning["fields"]["generation"] == 1 and "ModelCheckpoint beside TrainerdCallback" in \
            warning["message"], warning
        assert warned[JOBS / "callback_style.py"] == []
    finally:
        kept.unlink()
