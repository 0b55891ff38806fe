"""A spare's Standby (agent/supervisor.py `stand_by`): the agent prepares, for each worker it would run, what a
launch of the same processes would prepare (the same argv, import-time environment and working directory, so
the relaunch finds the warm templates started), starts nothing, and ignores a Standby while it runs processes
or one its launch policy would refuse."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from agent.commands import ProcessSpec, Standby
from agent.import_env import import_env_mismatch
from tests.agent.supervisor_fakes import PYTHON, Host, launch, run


def standby(generation: int = 1, entrypoint: str = "{python}", env: dict[str, str] | None = None,
            devices: tuple[int, ...] = (0, 1), workdir: str = "") -> Standby:
    return Standby(generation=generation, job_name="job", workdir=workdir, processes=tuple(
        ProcessSpec(role="worker", rank=-1, local_rank=i, device_id=d, argv=(entrypoint, "train.py"),
                    env={**(env or {}), "DEVICE_ID": str(d), "MS_ROLE": "MS_WORKER"}) for i, d in enumerate(devices)))


def test_a_spare_prepares_what_the_launch_in_a_lost_nodes_place_starts_and_starts_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        spare = Host(tmp_path / "spare")
        await spare.supervisor.stand_by(standby(env={"MS_ALLOC_CONF": "x", "TRAINERD_GENERATION": "1"}))
        assert spare.launcher.started == {} and spare.sent("process_started") == []
        prepared = list(spare.launcher.prepared)
        assert [argv for argv, _, _ in prepared] == [(PYTHON, "train.py")] * 2
        # Later the relaunch: this node in a lost one's place, generation 2, its ranks and ports.
        env = {"MS_ALLOC_CONF": "x", "TRAINERD_GENERATION": "2", "MS_SCHED_PORT": "6001"}
        relaunch = replace(launch(2, workers=0, env=env), processes=tuple(
            ProcessSpec(role="worker", rank=r + 2, local_rank=r, device_id=d, argv=("{python}", "train.py"),
                        env={**env, "DEVICE_ID": str(d), "RANK_ID": str(r + 2)}) for r, d in enumerate((0, 1))))
        await spare.supervisor.launch(relaunch)
        started = [spare.launcher.started[f"rank{r}"] for r in (2, 3)]
        for (argv, prepared_env, cwd), process in zip(prepared, started, strict=True):
            assert argv == tuple(process.argv) and cwd == process.cwd
            assert import_env_mismatch(prepared_env, process.env) == []  # the same template serves the start

    run(scenario())


def test_a_node_running_processes_or_refusing_the_entrypoint_prepares_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        busy = Host(tmp_path / "busy")
        await busy.supervisor.launch(launch(1))
        await busy.supervisor.stand_by(standby(2))
        assert len(busy.launcher.prepared) == 3  # the launch's scheduler and two workers, nothing more

        strict = Host(tmp_path / "strict")  # allows only the agent's interpreter
        await strict.supervisor.stand_by(standby(entrypoint="/bin/sh"))
        await strict.supervisor.stand_by(standby(workdir="../../etc"))
        assert strict.launcher.prepared == []

    run(scenario())
