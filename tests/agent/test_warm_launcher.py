"""Warm workers with real processes: which entrypoints qualify, what a warm-started process sees (argv,
env, cwd, log, exit status, its own session), and the cold fallback when the import-time environment
differs. The warm workers here preload a small marker module instead of MindSpore, so that a script
can tell whether it was started warm; tests/agent/test_import_env.py covers what MindSpore reads."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from agent import compile_cache
from agent.compile_cache import CompileCacheLauncher, cache_key
from agent.import_env import import_env_mismatch
from agent.launcher import SubprocessLauncher
from agent.warm_launcher import UNKNOWN_EXIT_CODE, WarmLauncher, template_message, warm_entrypoint
from agent.warm_worker import module_file
from daemon.config import JobSettings
from daemon.job.launch_plan import node_processes
from daemon.job.placement import NodeOffer, place
from daemon.job.state import ResumePoint, ResumeSource, SnapshotHolder
from daemon.membership import DeviceInfo
from proto.vocabulary import ProcessRole
from tests.agent.test_launcher import alive

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]

REPORT = """
import os, sys
print("warm" if "warmmark" in sys.modules else "cold")
print("argv", sys.argv)
print("name", __name__)
print("cwd", os.getcwd())
print("path0", sys.path[0])
print("greeting", os.environ.get("GREETING"))
print("generation", os.environ.get("TRAINERD_GENERATION"))
print("pid", os.getpid(), os.getpgid(0), os.getsid(0))
print("nice", os.getpriority(os.PRIO_PROCESS, 0))
print("cmdline", open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode().split("\\0"))
sys.stdout.flush()
print("oops", file=sys.stderr)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def job(tmp_path: Path) -> dict:
    """A script, a module, a marker module for the warm workers to preload and a base environment."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "warmmark.py").write_text("")
    (tmp_path / "lib" / "reporter.py").write_text(REPORT)
    (tmp_path / "work").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "report.py").write_text(REPORT)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": f"{tmp_path / 'lib'}{os.pathsep}{REPO}",
           "GREETING": "hello", "TRAINERD_GENERATION": "1", "DEVICE_ID": "0"}
    return {"root": tmp_path, "cwd": tmp_path / "work", "script": str(tmp_path / "scripts" / "report.py"),
            "env": env}


def launcher_for(tmp_path: Path, capacity: int = 2, **kwargs) -> WarmLauncher:
    return WarmLauncher(SubprocessLauncher(), python=PY, log_path=tmp_path / "warm_workers.log", capacity=capacity,
                        preload=["warmmark"], **kwargs)


async def start_and_wait(launcher, argv: Sequence[str], env: Mapping[str, str], cwd: Path,
                         log_path: Path) -> tuple[int, int, dict[str, str]]:
    handle = await launcher.start(argv, env, cwd, log_path)
    code = await handle.wait()
    lines = log_path.read_text().splitlines()
    report = {line.split(" ", 1)[0]: line.split(" ", 1)[1] if " " in line else "" for line in lines}
    report["first"] = lines[0] if lines else ""
    report["mode"] = "warm" if "warm" in report else "cold" if "cold" in report else "?"
    return handle.pid, code, report


def template_pid(caplog: pytest.LogCaptureFixture, pid: int) -> int | None:
    """The template a start of `pid` was forked from, as the launcher logged it (None: started cold)."""
    for record in caplog.records:
        message = record.getMessage()
        if message.startswith(f"started pid {pid} warm"):
            return int(message.split("interpreter pid ")[1].split(")")[0])
    return None


@pytest.mark.parametrize(("argv", "expected"), [
    ([PY, "-m", "pkg.mod", "--steps", "3"], ["-m", "pkg.mod", "--steps", "3"]),
    ([PY, "train.py", "-x"], ["train.py", "-x"]),
    ([PY, "-u", "-m", "pkg.mod"], None),  # interpreter options: cold
    ([PY, "-c", "print(1)"], None),
    ([PY, "-m"], None),
    ([PY, "-m", "-x"], None),
    ([PY], None),
    (["/usr/bin/python3", "train.py"], None),  # not the agent's interpreter
    (["/bin/sh", "run.sh"], None),
    (["msrun", "--worker_num=2", "train.py"], None),
])
def test_only_the_agents_python_running_a_module_or_script_qualifies(argv, expected) -> None:
    assert warm_entrypoint(argv, PY) == expected


def test_only_variables_read_at_import_must_match() -> None:
    warm = {"DEVICE_ID": "0", "GLOG_v": "3", "MS_SCHED_PORT": "8118", "RANK_ID": "0", "PYTHONPATH": "/a"}
    assert import_env_mismatch(warm, {**warm, "MS_SCHED_PORT": "8119", "RANK_ID": "1", "TRAINERD_X": "1"}) == []
    assert import_env_mismatch(warm, {**warm, "DEVICE_ID": "1"}) == ["DEVICE_ID"]
    assert import_env_mismatch(warm, {k: v for k, v in warm.items() if k != "GLOG_v"}) == ["GLOG_v"]
    assert import_env_mismatch(warm, {**warm, "PYTHONPATH": "/b", "MS_DEV_X": "1"}) == ["MS_DEV_X", "PYTHONPATH"]


def test_a_warm_start_runs_the_script_like_a_cold_one(job: dict, caplog: pytest.LogCaptureFixture) -> None:
    """Both generations are forked from one template, each with its own environment, log and exit status;
    what the script sees is what a cold start of it sees."""
    caplog.set_level(logging.INFO, "agent.warm_launcher")
    root, cwd = job["root"], job["cwd"]
    argv = [PY, job["script"], "a", "b c"]

    async def scenario():
        cold_launcher = launcher_for(root, enabled=False)
        launcher = launcher_for(root)
        try:
            cold = await start_and_wait(cold_launcher, argv, {**job["env"], "EXIT_CODE": "3"}, cwd, root / "g0.log")
            first = await start_and_wait(launcher, argv, {**job["env"], "EXIT_CODE": "5"}, cwd, root / "g1.log")
            second_env = {**job["env"], "TRAINERD_GENERATION": "2", "GREETING": "again", "EXIT_CODE": "7"}
            (root / "g2.log").write_text("from before\n")
            second = await start_and_wait(launcher, argv, second_env, cwd, root / "g2.log")
            return cold, first, second
        finally:
            await launcher.close()

    (_, code0, cold), (pid1, code1, first), (pid2, code2, warm) = run(scenario())
    assert (cold["mode"], code0) == ("cold", 3)
    assert (first["mode"], code1) == ("warm", 5)
    assert warm["first"] == "from before"  # the log is appended to
    assert warm["mode"] == "warm" and code2 == 7
    for report in (cold, first, warm):
        assert report["argv"] == repr([job["script"], "a", "b c"])
        assert report["name"] == "__main__"
        assert report["cwd"] == str(cwd)
        assert report["path0"] == str(Path(job["script"]).parent)
        assert "oops" in report
    assert (warm["greeting"], warm["generation"]) == ("again", "2")  # the job's env, not the template's
    assert warm["pid"] == f"{pid2} {pid2} {pid2}"  # the tracked pid leads its own session and group
    assert warm["cmdline"] == repr([PY, job["script"], "a", "b c"])  # what ps shows
    # the template imports at the lowest priority (when the agent may restore it: root), its children run at the
    # agent's
    assert warm["nice"] == first["nice"] == cold["nice"] == str(os.getpriority(os.PRIO_PROCESS, 0))
    template = template_pid(caplog, pid1)
    assert template is not None and template_pid(caplog, pid2) == template  # one import for both
    assert "cold (warm workers are off)" in caplog.text


def test_a_module_runs_as_main_and_an_exception_exits_1_with_its_traceback(job: dict) -> None:
    root, cwd = job["root"], job["cwd"]
    (root / "lib" / "failing.py").write_text("raise RuntimeError('broken on purpose')\n")

    async def scenario():
        launcher = launcher_for(root)
        try:
            module = await start_and_wait(launcher, [PY, "-m", "reporter", "--x"], job["env"], cwd, root / "g2.log")
            failing = await start_and_wait(launcher, [PY, "-m", "failing"], job["env"], cwd, root / "g3.log")
            return module, failing
        finally:
            await launcher.close()

    (_, code, report), (_, failed_code, _) = run(scenario())
    assert report["mode"] == "warm" and code == 0
    assert report["argv"] == repr([str(root / "lib" / "reporter.py"), "--x"])
    assert report["name"] == "__main__" and report["path0"] == str(cwd)
    assert failed_code == 1
    text = (root / "g3.log").read_text()
    assert "Traceback" in text and "RuntimeError: broken on purpose" in text


def test_a_different_import_time_variable_or_directory_has_a_template_of_its_own_and_says_why(
        job: dict, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "agent.warm_launcher")
    root, cwd = job["root"], job["cwd"]
    argv = [PY, job["script"]]
    (root / "elsewhere").mkdir()

    async def scenario():
        launcher = launcher_for(root, capacity=3)
        try:
            first = await start_and_wait(launcher, argv, job["env"], cwd, root / "g1.log")
            new_port = await start_and_wait(launcher, argv, {**job["env"], "MS_SCHED_PORT": "9"}, cwd, root / "g2.log")
            other_device = await start_and_wait(launcher, argv, {**job["env"], "DEVICE_ID": "1"}, cwd, root / "g3.log")
            other_dir = await start_and_wait(launcher, argv, job["env"], root / "elsewhere", root / "g4.log")
            return first, new_port, other_device, other_dir
        finally:
            await launcher.close()

    starts = run(scenario())
    assert all(report["mode"] == "warm" for _, _, report in starts)
    first, new_port, other_device, other_dir = (template_pid(caplog, pid) for pid, _, _ in starts)
    assert new_port == first  # read only at init(): no reason for another import
    assert len({first, other_device, other_dir}) == 3
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "imported with other DEVICE_ID" in messages
    assert f"is in {cwd}" in messages


def test_beyond_its_capacity_the_oldest_template_forks_no_more_and_ends_after_its_children(job: dict) -> None:
    root, cwd, sleeper = job["root"], job["cwd"], sleeper_script(job)

    async def scenario():
        launcher = launcher_for(root, capacity=1)
        try:
            running = await launcher.start([PY, str(sleeper)], job["env"], cwd, root / "g1.log")
            (old,) = launcher._templates
            await start_and_wait(launcher, [PY, job["script"]], {**job["env"], "DEVICE_ID": "1"}, cwd, root / "g2.log")
            assert old.retired and old.process.returncode is None  # its child still runs
            third = await start_and_wait(launcher, [PY, job["script"]], job["env"], cwd, root / "g3.log")
            running.signal_group(signal.SIGKILL)
            code = await running.wait()
            old_exit = await asyncio.wait_for(old.process.wait(), 10)
            return code, old_exit, third, [t.process.pid for t in launcher._templates if t.usable], old.process.pid
        finally:
            await launcher.close()

    code, old_exit, third, usable, old_pid = run(scenario())
    assert code == -signal.SIGKILL and old_exit == 0
    assert third[2]["mode"] == "warm" and old_pid not in usable and len(usable) == 1


def test_a_signal_to_the_group_of_a_warm_started_process_reaches_its_children(job: dict) -> None:
    root, cwd = job["root"], job["cwd"]
    script = root / "scripts" / "spawner.py"
    script.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen(['sleep', '60'])\n"
                      "print('child', child.pid, flush=True)\n"
                      "time.sleep(60)\n")

    async def warm_scenario():
        launcher = launcher_for(root)
        try:
            handle = await launcher.start([PY, str(script)], job["env"], cwd, root / "g2.log")
            for _ in range(500):
                if "child" in (root / "g2.log").read_text():
                    break
                await asyncio.sleep(0.02)
            child = int((root / "g2.log").read_text().split("child ")[1].split()[0])
            assert alive(child)
            handle.signal_group(signal.SIGTERM)
            code = await handle.wait()
            for _ in range(100):
                if not alive(child):
                    break
                await asyncio.sleep(0.02)
            return code, alive(child)
        finally:
            await launcher.close()

    code, child_alive = run(warm_scenario())
    assert code == -signal.SIGTERM
    assert not child_alive


def sleeper_script(job: dict) -> Path:
    """A script that prints a line and sleeps for a minute."""
    sleeper = job["root"] / "scripts" / "sleeper.py"
    sleeper.write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(60)\n")
    return sleeper


def test_a_forked_child_leads_its_own_group_as_soon_as_its_start_returns(job: dict) -> None:
    """The agent signals a process's group (its pid): a Stop sent the moment a start returned must reach the
    child, so the template tells its pid only once the child has its own session."""
    root, cwd, sleeper = job["root"], job["cwd"], sleeper_script(job)

    async def scenario():
        launcher = launcher_for(root)
        try:
            codes = []
            for i in range(5):
                handle = await launcher.start([PY, str(sleeper)], job["env"], cwd, root / f"g{i}.log")
                leads = os.getpgid(handle.pid) == handle.pid
                handle.signal_group(signal.SIGKILL)
                codes.append((leads, await asyncio.wait_for(handle.wait(), 10)))
            return codes
        finally:
            await launcher.close()

    assert run(scenario()) == [(True, -signal.SIGKILL)] * 5


def test_a_child_whose_template_was_killed_is_still_seen_to_end(job: dict, caplog: pytest.LogCaptureFixture) -> None:
    """Its exit status went with the template (its parent): the end is seen, the status is unknown."""
    root, cwd, sleeper = job["root"], job["cwd"], sleeper_script(job)

    async def scenario():
        launcher = launcher_for(root)
        try:
            handle = await launcher.start([PY, str(sleeper)], job["env"], cwd, root / "g1.log")
            (template,) = launcher._templates
            os.kill(template.process.pid, signal.SIGKILL)
            await template.process.wait()
            for _ in range(100):
                if not template.usable:
                    break
                await asyncio.sleep(0.02)
            assert alive(handle.pid)
            handle.signal_group(signal.SIGKILL)
            code = await asyncio.wait_for(handle.wait(), 10)
            after = await start_and_wait(launcher, [PY, job["script"]], job["env"], cwd, root / "g2.log")
            return code, after
        finally:
            await launcher.close()

    code, after = run(scenario())
    assert code == UNKNOWN_EXIT_CODE
    assert after[2]["mode"] == "warm"  # from a new template
    assert "exit status will be unknown" in caplog.text


@pytest.mark.parametrize(("data", "expected"), [
    (b"forked 4242", ("forked", 4242, 0)),
    (b"exited 4242 -9", ("exited", 4242, -9)),
    (b"exited 4242 3", ("exited", 4242, 3)),
    (b"", None), (b"   ", None), (b"forked", None), (b"forked x", None), (b"forked 0", None),
    (b"forked 99999999999", None), (b"exited 4242", None), (b"exited 4242 1e9", None), (b"exited 4242 256", None),
    (b"forked 1 2", None), (b"\xff\xfe", None), (b"spawned 12", None),
])
def test_a_templates_messages_are_checked_before_they_are_believed(data: bytes, expected) -> None:
    """A template runs as the workers' user: what it tells the agent is parsed strictly and bounded."""
    assert template_message(data) == expected


def test_a_template_that_breaks_the_protocol_is_not_listened_to_and_the_start_goes_cold(
        job: dict, caplog: pytest.LogCaptureFixture) -> None:
    """Its preload (code of the workers' user) writes a false report into the control socket."""
    caplog.set_level(logging.INFO, "agent.warm_launcher")
    root, cwd = job["root"], job["cwd"]
    (root / "lib" / "liar.py").write_text("import os, sys\nos.write(int(sys.argv[1]), b'exited 1 nonsense')\n")

    async def scenario():
        launcher = WarmLauncher(SubprocessLauncher(), python=PY, log_path=root / "warm_workers.log", capacity=2,
                                preload=["liar"])
        try:
            pid, code, report = await start_and_wait(launcher, [PY, job["script"]], job["env"], cwd, root / "g1.log")
            return code, report, [t.usable for t in launcher._templates]
        finally:
            await launcher.close()

    code, report, usable = run(scenario())
    assert code == 0 and report["mode"] == "cold" and usable == [False]
    assert "sent b'exited 1 nonsense': not listening to it any more" in caplog.text
    assert "cold (the warm template could not fork" in caplog.text


def test_with_warm_workers_off_everything_starts_cold(job: dict, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "agent.warm_launcher")
    root, cwd = job["root"], job["cwd"]

    async def scenario():
        launcher = launcher_for(root, enabled=False)
        try:
            await launcher.prepare([PY, job["script"]], job["env"], cwd)
            first = await start_and_wait(launcher, [PY, job["script"]], job["env"], cwd, root / "g1.log")
            second = await start_and_wait(launcher, [PY, job["script"]], job["env"], cwd, root / "g2.log")
            return first, second, list(launcher._templates)
        finally:
            await launcher.close()

    first, second, templates = run(scenario())
    assert first[2]["mode"] == second[2]["mode"] == "cold"
    assert templates == []
    assert "cold (warm workers are off)" in caplog.text


def test_a_template_exits_when_the_agent_closes_its_end_once_its_children_have_ended(job: dict) -> None:
    root, cwd, sleeper = job["root"], job["cwd"], sleeper_script(job)

    async def scenario():
        launcher = launcher_for(root)
        await launcher.prepare([PY, job["script"]], job["env"], cwd)
        handle = await launcher.start([PY, str(sleeper)], job["env"], cwd, root / "g1.log")
        (template,) = launcher._templates
        template.control.close()  # what the agent's exit does too
        await asyncio.sleep(0.5)
        still_there = template.process.returncode is None
        handle.signal_group(signal.SIGKILL)
        return still_there, await asyncio.wait_for(template.process.wait(), 10)

    assert run(scenario()) == (True, 0)


class RecordingLauncher:
    def __init__(self) -> None:
        self.envs: list[dict[str, str]] = []

    async def start(self, argv, env, cwd, log_path):
        self.envs.append(dict(env))
        return None


def test_the_compile_cache_directory_follows_the_job_configuration_not_the_generation(tmp_path: Path) -> None:
    argv = [PY, "-m", "trainer.examples.mlp", "--steps", "10"]
    env = {"MS_WORKER_NUM": "2", "RANK_SIZE": "2", "RANK_ID": "1", "TRAINERD_GLOBAL_BATCH": "64",
           "TRAINERD_MICRO_BATCH": "32", "TRAINERD_GRAD_ACCUM": "1", "MS_SCHED_PORT": "8118",
           "TRAINERD_GENERATION": "1", "TRAINERD_RESUME_STEP": "", "RANK_TABLE_FILE": "/g/000001/rank_table.json"}
    key = cache_key(argv, env, tmp_path)
    next_generation = {**env, "MS_SCHED_PORT": "8119", "TRAINERD_GENERATION": "2", "TRAINERD_RESUME_STEP": "100",
                       "RANK_TABLE_FILE": "/g/000002/rank_table.json"}
    assert cache_key(argv, next_generation, tmp_path) == key
    for changed in ({"MS_WORKER_NUM": "3", "RANK_SIZE": "3"}, {"TRAINERD_MICRO_BATCH": "16"},
                    {"TRAINERD_GRAD_ACCUM": "2"}, {"RANK_ID": "0"}, {"MY_MODEL_WIDTH": "512"}):
        assert cache_key(argv, {**env, **changed}, tmp_path) != key, changed
    assert cache_key([*argv, "--seed", "1"], env, tmp_path) != key

    inner = RecordingLauncher()
    launcher = CompileCacheLauncher(inner, tmp_path / "cache")
    run(launcher.start(argv, env, tmp_path, tmp_path / "log"))
    run(launcher.start(argv, {**env, "MS_COMPILER_CACHE_ENABLE": "0"}, tmp_path, tmp_path / "log"))
    enabled, own = inner.envs
    assert enabled["MS_COMPILER_CACHE_ENABLE"] == "1"
    assert enabled["MS_COMPILER_CACHE_PATH"] == str(tmp_path / "cache" / key)
    assert (tmp_path / "cache" / key).is_dir()
    assert own["MS_COMPILER_CACHE_ENABLE"] == "0" and "MS_COMPILER_CACHE_PATH" not in own  # the job's own choice


def test_every_relaunch_of_one_placement_finds_the_graph_its_first_generation_compiled(tmp_path: Path) -> None:
    """The coordinator's own launch plans, from scratch, from disk and from memory at two steps: each rank's
    cache directory is the same in all four (a relaunch from memory compiled anew while its resume step was
    part of the key), and another world size or batch split has its own."""
    job = JobSettings.model_validate(dict(name="j", entrypoint=["{python}", "-m", "trainer.examples.mlp"],
                                          devices_per_node=1, min_nodes=2, max_nodes=3, global_batch=48,
                                          micro_batch=8))
    offers = [NodeOffer(f"n{i}", f"10.0.0.{i + 1}", (DeviceInfo(0, "", "cpu"),)) for i in range(3)]
    holders = tuple(SnapshotHolder(rank, f"n{rank}", f"10.0.0.{rank + 1}:7000") for rank in range(3))
    resumes = [None, ResumePoint(400, 400 * 48, "/ckpt/step_00000400"),
               ResumePoint(128, 128 * 48, "", ResumeSource.MEMORY, holders),
               ResumePoint(256, 256 * 48, "", ResumeSource.MEMORY, holders)]

    def keys(placement, generation: int, resume) -> dict[int, str]:
        return {plan.rank: cache_key(plan.argv, plan.env, tmp_path)
                for node in placement.nodes
                for plan in node_processes(job, placement, generation, node, resume, peers_serve=True)
                if plan.role is ProcessRole.WORKER}

    three = place(job, offers)
    assert three is not None and three.world_size == 3
    first = keys(three, 1, None)
    assert len(set(first.values())) == 3  # a directory per rank
    for generation, resume in enumerate(resumes[1:], start=2):
        assert keys(three, generation, resume) == first, resume
    two = place(job, offers[:2])
    assert two is not None and two.world_size == 2
    assert not set(keys(two, 5, resumes[2]).values()) & set(first.values())  # another world size, batch split


def test_the_least_recently_used_compile_caches_go_beyond_the_kept_number(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(compile_cache, "KEPT_CACHES", 3)
    root = tmp_path / "cache"
    root.mkdir()
    for age, name in enumerate(["d1", "d2", "d3", "d4"]):  # d1 used last
        (root / name / "rank_0").mkdir(parents=True)
        os.utime(root / name, (1_700_000_000 - age * 60,) * 2)
    (root / "a-file").write_text("not a cache")
    argv = [PY, "-m", "trainer.examples.mlp"]
    a, b = {"RANK_ID": "0"}, {"RANK_ID": "1"}
    launcher = CompileCacheLauncher(RecordingLauncher(), root)

    def kept() -> set[str]:
        return {p.name for p in root.iterdir()}

    run(launcher.start(argv, a, tmp_path, tmp_path / "log"))
    assert kept() == {cache_key(argv, a, tmp_path), "d1", "d2", "a-file"}
    run(launcher.start(argv, b, tmp_path, tmp_path / "log"))
    assert kept() == {cache_key(argv, a, tmp_path), cache_key(argv, b, tmp_path), "d1", "a-file"}
    run(launcher.start(argv, a, tmp_path, tmp_path / "log"))  # in use again: nothing goes
    assert kept() == {cache_key(argv, a, tmp_path), cache_key(argv, b, tmp_path), "d1", "a-file"}


def test_the_entry_script_of_a_module_is_the_file_python_m_runs(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "runme").mkdir()
    (tmp_path / "runme" / "__init__.py").write_text("")
    (tmp_path / "runme" / "__main__.py").write_text("")
    (tmp_path / "runme" / "tool.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_file("runme.tool") == str(tmp_path / "runme" / "tool.py")
    assert module_file("runme") == str(tmp_path / "runme" / "__main__.py")
    assert module_file("no_such_module_here") is None
    assert module_file("runme.missing.deeper") is None
