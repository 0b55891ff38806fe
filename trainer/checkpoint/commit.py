"""The commit protocol between writing ranks that share only a filesystem.

1. Every rank writes `rank_{r}.safetensors` (temporary name, fsync, rename), then its report
   `rank_{r}.done.json` the same way: the file's size and digest, and the chunks it holds of each tensor,
   stamped with the step, the world size and the generation (the launch of the job that is saving).
2. Rank 0 waits until the reports of all ranks of its generation exist, merges them, checks the merged
   layout (every tensor covered exactly once, dtypes and shapes agreeing) and that every file has its size,
   then writes `manifest.json` (temporary name, fsync, rename, fsync of the directory). That rename is the
   commit. The reports and any file the manifest does not list are removed afterwards.

A report from another generation (a launch that died mid-save at the same step) is never taken for this
one's: rank 0 keeps waiting for the right one, up to its timeout, and the step stays uncommitted.

A rank that cannot write its share (the disk is full) leaves an empty `rank_{r}.failed.{generation}` instead
of its report, when it can (an empty file needs no data block): rank 0 then gives the step up at once
rather than after its timeout, so the next save, which waits for this one, does not hold training up.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.atomic_write import fsync_dir, write_atomically
from common.clock import Clock
from trainer.checkpoint.errors import CheckpointError, CorruptCheckpoint
from trainer.checkpoint.json_fields import check_schema, get_int, read_json_file
from trainer.checkpoint.layout import TensorLayout, layouts_from_json
from trainer.checkpoint.manifest import MANIFEST_NAME, CheckpointMeta, FileEntry, Manifest, step_dir_name
from trainer.checkpoint.rank_file import rank_file_name
from trainer.checkpoint.step_dirs import check_data_file

log = logging.getLogger(__name__)


def report_name(rank: int) -> str:
    return f"rank_{rank}.done.json"


@dataclass(frozen=True)
class RankReport:
    """What one rank wrote for one save: its file and, for every tensor, the chunks in that file."""

    rank: int
    world_size: int
    generation: int
    step: int
    file: FileEntry
    tensors: dict[str, TensorLayout] = field(hash=False)
    # The save's meta: a snapshot written without a commit (scope host) carries it, so that whoever
    # assembles the ranks' files into a checkpoint can take rank 0's. Optional when read.
    meta: CheckpointMeta | None = field(default=None, hash=False)

    def to_json(self) -> dict[str, Any]:
        extra = {} if self.meta is None else {"meta": self.meta.to_json()}
        return {
            "schema": 1,
            "rank": self.rank,
            "world_size": self.world_size,
            "generation": self.generation,
            "step": self.step,
            "file": self.file.to_json(),
            "tensors": {name: t.to_json() for name, t in sorted(self.tensors.items())},
            **extra,
        }

    @staticmethod
    def from_json(obj: dict[str, Any], where: str) -> RankReport:
        check_schema(obj, where)
        return RankReport(
            rank=get_int(obj, "rank", where),
            world_size=get_int(obj, "world_size", where, minimum=1),
            generation=get_int(obj, "generation", where),
            step=get_int(obj, "step", where),
            file=FileEntry.from_json(obj.get("file"), f"{where}: file"),
            tensors=layouts_from_json(obj, where),
            meta=None if obj.get("meta") is None else CheckpointMeta.from_json(obj["meta"], f"{where}: meta"),
        )


def failure_name(rank: int, generation: int) -> str:
    return f"rank_{rank}.failed.{generation}"


def mark_failed(step_dir: Path, rank: int, generation: int) -> None:
    """Tell rank 0 that this rank's share of the save will not come; best effort (the disk may be full)."""
    try:
        (step_dir / failure_name(rank, generation)).touch()
    except OSError as exc:
        log.warning("rank %d could not mark its save in %s as failed: %s", rank, step_dir, exc)


def prepare_share(root: Path, step: int, rank: int, generation: int, *, commits: bool) -> Path:
    """The step directory of `step` under `root`, created, without what an earlier save of that step left
    of `rank`'s share; for the rank that `commits`, also without the manifest it is about to replace."""
    step_dir = root / step_dir_name(step)
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / report_name(rank)).unlink(missing_ok=True)
    (step_dir / failure_name(rank, generation)).unlink(missing_ok=True)
    if commits and (step_dir / MANIFEST_NAME).exists():
        log.warning("Rank 0 replaces the existing checkpoint %s with generation %d's save.", step_dir, generation)
        (step_dir / MANIFEST_NAME).unlink()
    return step_dir


def link_share(step_dir: Path, root: Path, report: RankReport) -> Path:
    """Place `report`'s share, written in `step_dir`, also under `root` (in its step directory there), as a
    writer with `commit=False` rooted there leaves it: the data file as a hard link (the two roots must be on
    one file system; a written data file is never written again, a later save of the step writes a new one),
    then the report. The in-memory snapshot of a step hands itself to the agent's outbox this way
    (`checkpoint.saved_by: agent`) without a second copy. Returns the step directory under `root`."""
    target = prepare_share(root, report.step, report.rank, report.generation, commits=False)
    name = rank_file_name(report.rank)
    (target / name).unlink(missing_ok=True)
    os.link(step_dir / name, target / name)
    write_report(target, report)
    return target


def commit_when_reported(step_dir: Path, meta: CheckpointMeta, world_size: int, generation: int,
                         timeout_s: float, poll_interval_s: float, clock: Clock) -> None:
    """Rank 0's part: wait for every rank's report of this save (`collect_reports`), merge them and commit
    the manifest. Raises CheckpointError when a rank failed, timed out, or the files do not check out."""
    reports = collect_reports(step_dir, world_size, generation, meta.step, timeout_s, poll_interval_s, clock)
    files, tensors = merge_reports(reports)
    commit_manifest(step_dir, Manifest(meta, world_size, generation, files, tensors))


def write_report(step_dir: Path, report: RankReport) -> None:
    _write_json(step_dir / report_name(report.rank), report.to_json())


def _write_json(path: Path, document: dict[str, Any]) -> None:
    write_atomically(path, json.dumps(document, indent=1, sort_keys=True).encode())


def _read_report(step_dir: Path, rank: int, world_size: int, generation: int, step: int) -> RankReport | None:
    """This save's report of `rank`, or None while it is absent or left over from another save."""
    path = step_dir / report_name(rank)
    if not path.exists():
        return None
    report = RankReport.from_json(read_json_file(path, f"{step_dir.name}/{path.name}"), f"{step_dir.name}/{path.name}")
    if (report.rank, report.world_size, report.generation, report.step) != (rank, world_size, generation, step):
        return None
    return report


def collect_reports(
    step_dir: Path,
    world_size: int,
    generation: int,
    step: int,
    timeout_s: float,
    poll_interval_s: float,
    clock: Clock,
) -> list[RankReport]:
    """Waits until every rank's report for this save exists; CheckpointError after `timeout_s`, or as soon
    as a rank of this generation marked its share failed."""
    deadline = clock.now() + timeout_s
    reports: dict[int, RankReport] = {}
    while True:
        for rank in range(world_size):
            if rank not in reports:
                report = _read_report(step_dir, rank, world_size, generation, step)
                if report is not None:
                    reports[rank] = report
        if len(reports) == world_size:
            return [reports[r] for r in range(world_size)]
        failed = [r for r in range(world_size)
                  if r not in reports and (step_dir / failure_name(r, generation)).exists()]
        if failed:
            raise CheckpointError(f"{step_dir.name}: ranks {failed} could not write their share; not committed")
        if clock.now() >= deadline:
            missing = sorted(set(range(world_size)) - set(reports))
            raise CheckpointError(
                f"{step_dir.name}: ranks {missing} did not finish writing within {timeout_s:g} s; not committed"
            )
        clock.sleep(poll_interval_s)


def merge_reports(reports: Sequence[RankReport]) -> tuple[tuple[FileEntry, ...], dict[str, TensorLayout]]:
    """All ranks' files and chunks as one layout; CheckpointError when ranks disagree on a tensor."""
    tensors: dict[str, TensorLayout] = {}
    names = set(reports[0].tensors)
    for report in reports:
        if set(report.tensors) != names:
            differ = sorted(names.symmetric_difference(report.tensors))
            raise CheckpointError(f"rank {report.rank} saved a different set of tensors than rank 0: {differ[:5]}")
        for name, layout in report.tensors.items():
            known = tensors.get(name)
            if known is None:
                tensors[name] = layout
                continue
            if (known.dtype, known.shape) != (layout.dtype, layout.shape):
                raise CheckpointError(
                    f"tensor '{name}': rank {report.rank} saved {layout.dtype} {list(layout.shape)}, "
                    f"rank 0 {known.dtype} {list(known.shape)}"
                )
            tensors[name] = TensorLayout(known.dtype, known.shape, known.chunks + layout.chunks)
    return tuple(r.file for r in reports), tensors


def commit_manifest(step_dir: Path, manifest: Manifest) -> None:
    """Checks the layout and the files, writes the manifest atomically, then removes what it does not list."""
    try:
        manifest.validate()
        for entry in manifest.files:
            check_data_file(step_dir, entry)
    except CorruptCheckpoint as exc:
        raise CheckpointError(f"{step_dir.name}: not committed: {exc}") from exc
    fsync_dir(step_dir.parent)  # the step directory itself must survive a crash before the commit counts
    _write_json(step_dir / MANIFEST_NAME, manifest.to_json())
    listed = {entry.name for entry in manifest.files} | {MANIFEST_NAME}
    for child in step_dir.iterdir():
        if child.name not in listed and child.is_file():
            child.unlink()
    fsync_dir(step_dir)
    log.info(
        "Committed checkpoint %s: step %d, %d files, %d bytes, world size %d.",
        step_dir, manifest.step, len(manifest.files), manifest.total_bytes, manifest.world_size,
    )
