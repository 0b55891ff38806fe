"""In-memory snapshots of a generation spanning hosts (TRAINERD_MEMORY_SCOPE=host): every rank writes its
file and its report, with the meta, and returns; no rank waits for the others, commits or prunes; with
"auto" each rank chooses a power-of-two interval, so the steps every rank snapshots need no shared plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.clock import FakeClock
from trainer.checkpoint import CheckpointMeta
from trainer.checkpoint.commit import RankReport, report_name
from trainer.checkpoint.json_fields import read_json_file
from trainer.checkpoint.manifest import MANIFEST_NAME, step_dir_name
from trainer.runtime.memory_snapshots import PLAN_NAME, MemorySnapshots, power_of_two_interval
from trainer.runtime.snapshot_interval import FIRST_SNAPSHOT_AFTER


def meta(step: int) -> CheckpointMeta:
    return CheckpointMeta(step=step, consumed_samples=step * 8, data_seed=3, skip_ledger=((16, 24),))


def test_each_rank_writes_its_file_and_report_with_the_meta_and_nobody_commits_or_prunes(tmp_path: Path) -> None:
    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, dtype=np.float16)}
    # Rank 1 of 3 alone: a rank of scope host waits for nobody (the others write on other hosts).
    memory = MemorySnapshots(tmp_path, 2, 1, 3, 7, "rank 1", FakeClock(), 1000, scope_host=True)
    for step in (2, 4, 6):
        memory.save(meta(step), tensors, {})
    memory.close()
    for step in (2, 4, 6):  # no pruning: the agent decides what goes
        step_dir = tmp_path / step_dir_name(step)
        assert not (step_dir / MANIFEST_NAME).exists()
        assert (step_dir / "rank_1.safetensors").is_file()
        report = RankReport.from_json(read_json_file(step_dir / report_name(1), "report"), "report")
        assert (report.rank, report.world_size, report.generation, report.step) == (1, 3, 7, step)
        assert report.meta == meta(step)
        assert report.file.size == (step_dir / "rank_1.safetensors").stat().st_size


def test_a_report_without_meta_still_reads() -> None:
    memory_report = {"schema": 1, "rank": 0, "world_size": 1, "generation": 0, "step": 1,
                     "file": {"name": "rank_0.safetensors", "size": 0, "digest": "xxh3-128:" + "0" * 32},
                     "tensors": {}}
    assert RankReport.from_json(memory_report, "report").meta is None


def test_power_of_two_intervals_round_up_within_the_cap() -> None:
    assert [power_of_two_interval(n, 1000) for n in (1, 2, 3, 25, 64, 65)] == [1, 2, 4, 32, 64, 128]
    assert power_of_two_interval(900, 1000) == 512  # 1024 is beyond the cap
    assert power_of_two_interval(5, 1) == 1


def test_auto_intervals_of_ranks_nest_so_the_slowest_ranks_steps_are_snapshotted_by_all(tmp_path: Path) -> None:
    clock = FakeClock()
    stalls = [0.5, 0.3, 1.0]  # each rank measures its own stall: 25, 15 and 50 steps at 1 s per step
    ranks = [MemorySnapshots(tmp_path, "auto", rank, 3, 1, f"rank {rank}", clock, 1000, scope_host=True)
             for rank in range(3)]
    taken: list[set[int]] = [set() for _ in ranks]
    for step in range(41, 400):
        clock.advance(1.0)
        for rank, memory in enumerate(ranks):
            if memory.due(step):
                taken[rank].add(step)
                memory.snapshotted(step, stalls[rank])
    assert all(min(t) == 40 + FIRST_SNAPSHOT_AFTER for t in taken)
    assert sorted(taken[1])[1:4] == [48, 64, 80]   # 15 -> 16
    assert sorted(taken[0])[1:4] == [64, 96, 128]  # 25 -> 32
    assert sorted(taken[2])[1:4] == [64, 128, 192]  # 50 -> 64
    common = taken[0] & taken[1] & taken[2]
    assert sorted(common) == [45, 64, 128, 192, 256, 320, 384]
    assert not (tmp_path / PLAN_NAME).exists()


def test_a_fixed_interval_in_scope_host_is_every_multiple(tmp_path: Path) -> None:
    memory = MemorySnapshots(tmp_path, 7, 2, 3, 1, "rank 2", FakeClock(), 1000, scope_host=True)
    assert [step for step in range(1, 30) if memory.due(step)] == [7, 14, 21, 28]
