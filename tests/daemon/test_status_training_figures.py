"""`trainerctl status` shows the training figures a user watches: step, loss and the gradient norm, for
the job and per rank (`-o json` holds the same), from the coordinator's own view."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from daemon.cli.status_json import status_to_json
from daemon.cli.trainerctl import print_status
from daemon.grpc_services import status_to_proto
from tests.daemon.job_sim import SimCluster, job_settings


def status_after_step_42(**figures: float) -> dict:
    """`status -o json` once every rank of a running job reported step 42 (loss 0.5, gradient norm 1.0, or
    `figures`)."""
    async def go() -> dict:
        sim = SimCluster(job_settings())
        await sim.lead()
        for name in ("a", "b", "c"):
            await sim.connect(name)
        await sim.tick()
        sim.started()
        await sim.tick(1.0)
        sim.step(42, **figures)
        await sim.tick()
        return status_to_json(status_to_proto(await sim.coordinator.view()))

    return asyncio.run(go())


def test_status_shows_step_loss_and_gradient_norm(capsys: pytest.CaptureFixture[str]) -> None:
    data = status_after_step_42()
    job = data["job"]
    assert (job["step"], job["loss"], job["grad_norm"]) == (42, 0.5, 1.0)
    assert {(r["step"], r["grad_norm"]) for r in job["ranks"]} == {(42, 1.0)}
    print_status(data)
    out = capsys.readouterr().out
    assert "step 42" in out and "loss 0.5000" in out and "grad norm 1" in out


def test_a_figure_a_rank_reports_as_nan_is_null_in_json_and_a_dash_in_the_table(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A rank whose loop passes no gradient norm (TrainerdLoop, a callback over a plain TrainOneStepCell) reports
    NaN for it; `status -o json` stays JSON (no `NaN` literal, which jq refuses)."""
    data = status_after_step_42(grad_norm=math.nan, loss=math.inf)
    job = data["job"]
    assert (job["step"], job["loss"], job["grad_norm"]) == (42, None, None)
    assert {(r["step"], r["loss"], r["grad_norm"]) for r in job["ranks"]} == {(42, None, None)}
    json.loads(json.dumps(data, allow_nan=False))
    print_status(data)
    out = capsys.readouterr().out
    assert "step 42  loss -  grad norm -" in out, out


@pytest.mark.parametrize("step, lost_steps, shown", [
    (578, 1, "from step 578 (disk), 1 step lost): stop"), (578, 2, "from step 578 (disk), 2 steps lost): stop"),
    (578, None, "from step 578 (disk)): stop"),
    (None, None, "from the script's own checkpoint, if it keeps one): stop")])
def test_status_says_where_the_last_recovery_resumed_and_what_it_lost(step, lost_steps, shown,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    async def go() -> dict:
        sim = SimCluster(job_settings())
        await sim.lead()
        return status_to_json(status_to_proto(await sim.coordinator.view()))

    data = asyncio.run(go())
    data["job"]["last_recovery"] = {"cause": "resume", "resumed_from_step": step,
                                    "resumed_from": "" if step is None else "disk",
                                    "lost_steps": lost_steps, "stop_s": 0.0, "relaunch_s": 0.0,
                                    "first_step_s": 5.85, "total_s": 5.85,
                                    "cost_s": {"detect": 0.0, "stop": 0.0, "relaunch": 1.25, "comm_setup": 2.5,
                                               "compile": 1.5, "load": 0.6, "lost_work": 0.0}}
    print_status(data)
    out = capsys.readouterr().out
    assert f"last recovery (resume, {shown}" in out, out
    assert ("  cost 5.85s: detect 0.00s  stop 0.00s  relaunch 1.25s  comm setup 2.50s  compile 1.50s  load 0.60s  "
            "lost work 0.00s") in out, out


def test_a_narrow_terminal_never_cuts_the_node_names_that_tell_the_rows_apart(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    data = status_after_step_42()
    long_names = {node["name"]: f"trainerd-local-{i}" for i, node in enumerate(data["nodes"])}
    for node in data["nodes"]:
        node["name"] = long_names[node["name"]]
        node["crashes"] = 1  # 'in service (1 crash)' widens the table past 80 columns
    for rank in data["job"]["ranks"]:
        rank["node"] = long_names[rank["node"]]
    monkeypatch.setenv("COLUMNS", "80")
    print_status(data)
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines() if "│" in line) <= 80  # the tables fit the terminal
    for name in long_names.values():
        assert out.count(f" {name} ") == 2  # its row in the nodes table and its rank's in the ranks table
