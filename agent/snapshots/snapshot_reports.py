"""The per-rank reports of in-memory snapshots taken in scope host (trainer/runtime/memory_snapshots.py).

In a generation spanning hosts no rank commits a snapshot: each writes `rank_{r}.safetensors`, then its
report `rank_{r}.done.json` (the disk checkpoint's RankReport, with the save's meta), into its own agent's
directory. A rank's share of a step counts once its report is there, names this rank and step, carries the
meta, and its data file is a regular file of the size it says. The files are the workers' (or, for
copies, a peer's): they are read without following links, only regular files, at most
`json_fields.MAX_JSON_BYTES` (trainer/checkpoint/json_fields.py, file_access.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from trainer.checkpoint.commit import RankReport, report_name
from trainer.checkpoint.errors import CorruptCheckpoint
from trainer.checkpoint.json_fields import read_json_file
from trainer.checkpoint.rank_file import rank_file_name
from trainer.checkpoint.step_dirs import check_data_file

_REPORT = re.compile(r"rank_(\d{1,6})\.done\.json")


def report_mismatch(report: RankReport, rank: int, step: int) -> str:
    """Why `report` is not `rank`'s share of `step` ('' when it is)."""
    if (report.rank, report.step) != (rank, step) or report.meta is None or report.file.name != rank_file_name(rank):
        return (f"its report is of rank {report.rank}, step {report.step}, file {report.file.name!r:.80}"
                f"{'' if report.meta else ', without meta'}")
    return ""


def read_report(step_dir: Path, rank: int, step: int) -> RankReport | None:
    """`rank`'s report of `step` in `step_dir` once it and its data file are whole, else None."""
    where = f"{step_dir.name}/{report_name(rank)}"
    try:
        report = RankReport.from_json(read_json_file(step_dir / report_name(rank), where), where)
        if report_mismatch(report, rank, step):
            return None
        check_data_file(step_dir, report.file)
    except (CorruptCheckpoint, OSError):
        return None
    return report


def reports_in(step_dir: Path, step: int) -> dict[int, RankReport]:
    """Every rank's whole report of `step` in `step_dir`, by rank (none when it cannot be listed)."""
    try:
        ranks = sorted({int(m.group(1)) for e in os.scandir(step_dir) if (m := _REPORT.fullmatch(e.name))})
    except OSError:
        return {}
    found = {rank: read_report(step_dir, rank, step) for rank in ranks}
    return {rank: report for rank, report in found.items() if report is not None}


def agree(reports: Iterable[RankReport]) -> bool:
    """Whether the reports are of one save: the same world size, generation and position in the data."""
    return len({(r.world_size, r.generation, r.meta.consumed_samples if r.meta else None) for r in reports}) <= 1
