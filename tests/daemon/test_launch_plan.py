"""Rank assignment, the HCCL rank table and the per-process environment, for 1x1, 2x8 and uneven hosts."""

from __future__ import annotations

import json

import pytest

from daemon.config import JobSettings
from daemon.job.launch_plan import node_processes, scheduler_argv, scheduler_port
from daemon.job.placement import NodeOffer, place
from daemon.job.rank_table import build_rank_table, rank_table_json
from daemon.membership import DeviceInfo
from proto.launch_env import AGENT_ENV, RESERVED_ENV, forbidden_job_env
from proto.vocabulary import SCHEDULER_ARGV, ProcessRole
from trainer.runtime.guard_policy import GuardSettings


def spec(**overrides) -> JobSettings:
    values = dict(name="j", entrypoint=["{python}", "-m", "trainer.examples.mlp"], devices_per_node=1,
                  min_nodes=1, max_nodes=1, global_batch=64, micro_batch=8)
    values.update(overrides)
    return JobSettings.model_validate(values)


def npu_node(name: str, host: str, ids: list[int]) -> NodeOffer:
    return NodeOffer(name, host, tuple(DeviceInfo(i, f"192.168.{i}.{host.rsplit('.', 1)[1]}", "npu") for i in ids))


def test_single_node_single_device() -> None:
    placement = place(spec(), [NodeOffer("n0", "10.0.0.1", (DeviceInfo(0, "", "cpu"),))])
    assert placement.world_size == 1 and placement.grad_accum == 8
    table = build_rank_table(placement)
    assert table == {
        "version": "1.0", "server_count": "1", "status": "completed",
        "server_list": [{"server_id": "10.0.0.1", "host_nic_ip": "reserve",
                         "device": [{"device_id": "0", "device_ip": "", "rank_id": "0"}]}],
    }
    processes = node_processes(spec(), placement, generation=3, node="n0")
    assert [p.role for p in processes] == [ProcessRole.SCHEDULER, ProcessRole.WORKER]
    sched, worker = processes
    assert sched.env["MS_ROLE"] == "MS_SCHED" and "MS_NODE_ID" not in sched.env
    for key, value in {"MS_ROLE": "MS_WORKER", "MS_SCHED_HOST": "10.0.0.1", "MS_SCHED_PORT": str(8118 + 3),
                       "MS_WORKER_NUM": "1", "MS_NODE_ID": "0", "RANK_ID": "0", "RANK_SIZE": "1",
                       "DEVICE_ID": "0", "TRAINERD_GENERATION": "3", "TRAINERD_GRAD_ACCUM": "8"}.items():
        assert worker.env[key] == value, key
    assert worker.argv == ("{python}", "-m", "trainer.examples.mlp")
    assert sched.argv == SCHEDULER_ARGV == ("{python}", "-m", "trainer.runtime.scheduler")


@pytest.mark.parametrize("entrypoint, scheduler", [
    (["{python}", "train.py", "--epochs", "3"], SCHEDULER_ARGV),  # none of the job's code in the scheduler
    (["/opt/conda/bin/python", "train.py"], ("/opt/conda/bin/python", "train.py")),  # as msrun: its MindSpore
    (["bash", "run.sh"], ("bash", "run.sh")),
])
def test_the_scheduler_is_trainerds_own_where_the_agents_interpreter_runs_the_job(entrypoint: list[str],
                                                                                  scheduler: tuple[str, ...]) -> None:
    assert scheduler_argv(spec(entrypoint=entrypoint)) == scheduler


def test_two_hosts_of_eight() -> None:
    job = spec(devices_per_node=8, min_nodes=2, max_nodes=2, global_batch=256, micro_batch=8)
    offers = [npu_node("b", "10.0.0.2", list(range(8))), npu_node("a", "10.0.0.1", list(range(7, -1, -1)))]
    placement = place(job, offers)
    assert placement.world_size == 16 and placement.grad_accum == 2
    assert [(r.rank, r.node, r.device_id, r.local_rank) for r in placement.ranks][:3] == [
        (0, "a", 0, 0), (1, "a", 1, 1), (2, "a", 2, 2)]
    assert placement.ranks[8].node == "b" and placement.ranks[8].device_id == 0
    table = json.loads(rank_table_json(placement))
    assert table["server_count"] == "2"
    assert [s["server_id"] for s in table["server_list"]] == ["10.0.0.1", "10.0.0.2"]
    second = table["server_list"][1]["device"]
    assert [d["rank_id"] for d in second] == [str(r) for r in range(8, 16)]
    assert second[3] == {"device_id": "3", "device_ip": "192.168.3.2", "rank_id": "11"}
    assert all(isinstance(v, str) for s in table["server_list"] for d in s["device"] for v in d.values())

    a = node_processes(job, placement, 1, "a")
    b = node_processes(job, placement, 1, "b")
    assert [p.role for p in a].count(ProcessRole.SCHEDULER) == 1
    assert all(p.role is ProcessRole.WORKER for p in b)
    assert [p.env["RANK_ID"] for p in b] == [str(r) for r in range(8, 16)]
    assert {p.env["MS_SCHED_HOST"] for p in a + b} == {"10.0.0.1"}
    assert {p.env["MS_WORKER_NUM"] for p in a + b} == {"16"}


def test_uneven_device_lists_take_the_largest_allowed_world_size() -> None:
    job = spec(devices_per_node=4, min_nodes=1, max_nodes=3, world_size_multiple_of=2, global_batch=48,
               micro_batch=2)
    offers = [npu_node("a", "10.0.0.1", [0, 1, 2, 3]), npu_node("b", "10.0.0.2", [5, 2]),
              npu_node("c", "10.0.0.3", [1])]
    placement = place(job, offers)
    # 7 devices on offer; 6 is the largest even size that divides 48/2 = 24.
    assert placement.world_size == 6 and placement.grad_accum == 4
    assert [(r.node, r.device_id) for r in placement.ranks] == [
        ("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 2), ("b", 5)]
    table = build_rank_table(placement)
    assert table["server_count"] == "2"  # c takes no rank


def test_survivors_keep_their_order_and_newcomers_follow() -> None:
    job = spec(max_nodes=4, global_batch=24, micro_batch=1)
    offers = [npu_node(n, f"10.0.0.{i + 1}", [0]) for i, n in enumerate(["a", "b", "c", "d"])]
    placement = place(job, offers, previous_order=["c", "a"])
    assert placement.nodes == ["c", "a", "b", "d"]


def test_a_world_regrown_on_the_nodes_it_had_gives_them_back_their_ranks() -> None:
    job = spec(max_nodes=3, global_batch=24, micro_batch=1)
    a, b, c, d = (npu_node(n, f"10.0.0.{i + 1}", [0]) for i, n in enumerate("abcd"))
    seen = {3: ("a", "b", "c"), 2: ("c", "a")}
    # b was lost (the survivors kept their order: a, c) and came back: the ranks of generation 1 again.
    assert place(job, [a, b, c], previous_order=["a", "c"]).nodes == ["a", "c", "b"]
    assert place(job, [a, b, c], previous_order=["a", "c"], orders_seen=seen).nodes == ["a", "b", "c"]
    # Other nodes than then at that size: the usual order (survivors, then newcomers by name).
    assert place(job, [a, c, d], previous_order=["a", "c"], orders_seen=seen).nodes == ["a", "c", "d"]
    # A size never seen: the usual order.
    assert place(spec(max_nodes=4, global_batch=24, micro_batch=1), [a, b, c, d], previous_order=["a", "c"],
                 orders_seen=seen).nodes == ["a", "c", "b", "d"]


def test_too_few_nodes_or_devices_gives_no_placement() -> None:
    job = spec(min_nodes=2, max_nodes=3, global_batch=12, micro_batch=1)
    assert place(job, [npu_node("a", "10.0.0.1", [0])]) is None
    assert place(spec(min_nodes=1, max_nodes=2, world_size_multiple_of=2, global_batch=4, micro_batch=1),
                 [npu_node("a", "10.0.0.1", [0])]) is None


def test_scheduler_port_changes_per_generation() -> None:
    assert scheduler_port(spec(), 1) != scheduler_port(spec(), 2)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"global_batch": 10, "micro_batch": 4}, "cannot be kept by any allowed world size"),
    ({"min_nodes": 3, "max_nodes": 2}, "max_nodes must be at least min_nodes"),
    ({"env": {"RANK_ID": "3"}}, "env may not set RANK_ID"),
    ({"entrypoint": []}, "at least 1 item"),
])
def test_job_spec_mistakes(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        spec(**overrides)


MSRUN_WORKER_ENV = {"MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID", "MS_TOPO_TIMEOUT",
                    "RANK_ID", "RANK_SIZE", "DEVICE_ID"}
MSRUN_SCHEDULER_ENV = {"MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_TOPO_TIMEOUT", "RANK_ID",
                       "RANK_SIZE"}


def test_every_variable_msrun_gives_a_process_is_set() -> None:
    """msrun 2.10 (parallel/cluster/process_entity/_api.py) gives these; a script written for it reads them."""
    placement = place(spec(max_nodes=2), [npu_node("n0", "10.0.0.1", [0]), npu_node("n1", "10.0.0.2", [0])])
    scheduler, worker0 = node_processes(spec(max_nodes=2), placement, generation=1, node="n0")
    (worker1,) = node_processes(spec(max_nodes=2), placement, generation=1, node="n1")
    assert MSRUN_SCHEDULER_ENV <= scheduler.env.keys()
    assert MSRUN_WORKER_ENV <= worker0.env.keys() and MSRUN_WORKER_ENV <= worker1.env.keys()
    assert (worker1.env["RANK_ID"], worker1.env["MS_NODE_ID"], worker1.env["MS_WORKER_NUM"]) == ("1", "1", "2")
    assert worker0.env["MS_TOPO_TIMEOUT"] == "600"


def test_a_job_without_a_batch_split_gets_no_batch_variables() -> None:
    plain = spec(global_batch=None, micro_batch=None)
    placement = place(plain, [NodeOffer("n0", "10.0.0.1", (DeviceInfo(0, "", "cpu"),))])
    _, worker = node_processes(plain, placement, generation=1, node="n0")
    assert placement.grad_accum == 1
    assert not {"TRAINERD_GLOBAL_BATCH", "TRAINERD_MICRO_BATCH", "TRAINERD_GRAD_ACCUM"} & worker.env.keys()


def test_an_agent_refuses_none_of_the_variables_the_coordinator_sets() -> None:
    """The agent checks every Launch against proto.launch_env.forbidden_job_env: trainerd's own must pass."""
    placement = place(spec(), [NodeOffer("n0", "10.0.0.1", (DeviceInfo(0, "", "cpu"),))])
    names = {name for process in node_processes(spec(), placement, generation=1, node="n0") for name in process.env}
    assert {name: forbidden_job_env(name) for name in names | AGENT_ENV} == dict.fromkeys(names | AGENT_ENV)
    assert forbidden_job_env("LD_PRELOAD") and forbidden_job_env("PYTHONPATH") and forbidden_job_env("TRAINERD_X")


@pytest.mark.parametrize("data_skip", [{}, {"spike_factor": 4.5, "spike_zscore": 7.25, "spike_ceiling": 16.0,
                                           "warmup_steps": 50}, {"spike_factor": float("inf")}])
def test_the_workers_read_the_guard_settings_the_job_asked_for(data_skip: dict) -> None:
    """The cluster file's job.data_skip reaches the worker's guard through the launch environment unchanged."""
    job = spec(data_skip=data_skip)
    placement = place(job, [NodeOffer("n0", "10.0.0.1", (DeviceInfo(0, "", "cpu"),))])
    _, worker = node_processes(job, placement, generation=1, node="n0")
    settings = GuardSettings.from_environ(worker.env)
    skip = job.data_skip
    assert (settings.spike_factor, settings.spike_zscore, settings.spike_ceiling, settings.warmup_steps) == (
        skip.spike_factor, skip.spike_zscore, skip.spike_ceiling, skip.warmup_steps)
    assert {name for name in worker.env if name.startswith("TRAINERD_SPIKE_")} <= RESERVED_ENV
