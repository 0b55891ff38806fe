"""Checkpoint I/O beside the raw disk: the same bytes, on the same disk, in the same run.

A model of about 1 GiB (16 x 4096x4096 float32 plus 16 biases) is saved and loaded through
trainer.checkpoint, and the same bytes are written and read with plain large-block I/O, `dd`-style:
buffered + fsync (`dd bs=16M conv=fsync`) and O_DIRECT (`dd oflag=direct` / `iflag=direct`), 16 MiB
blocks into one reused buffer. Each ratio is against the faster of the two. Loads start cold: the files
are evicted from the page cache first (posix_fadvise DONTNEED). Loads also get a second baseline: the same
files read with 4 threads into a new array of the payload's size, which is what any loader that returns
new tensors must at least do (on a VM, the first touch of memory costs; see the warm-up line).
Measurements are interleaved and repeated; each figure is a median. Every writer and every load case
first runs once untimed: training saves every few hundred steps, the first save allocates host buffers.

Printed: checksum speed (why crc32), save throughput (1 and 2 ranks writing at once), the time a
training step is blocked by an asynchronous save (first save, then later ones), by a save the agent writes
(`checkpoint.saved_by: agent`: the rank hands its share to the outbox in shared memory, --memory-dir, and
an agent persister in another process copies, verifies and commits it; agent/snapshots/checkpoint_persister.py; with
in-memory snapshots on, the share is the snapshot of the step, linked into the outbox), and
by an in-memory snapshot (the same writer into tmpfs, --memory-dir; trainer/runtime/memory_snapshots.py), and the
throughput of resharded loads 2->3 and 4->2: rank 0 loading the whole model (data parallel), and every
rank loading its dim-0 shards (summed).

Beside ours, when torch is installed (the `bench` extra, CPU torch): PyTorch Distributed Checkpoint (DCP) on
the same tensors (torch.from_numpy, no copy), with its default FileSystemWriter/Reader, evicted from the page
cache like ours before every load. Saves: 1 rank in DCP's single-process mode; 2 (and, for the loads, 2 and
4) ranks as forked processes in a real gloo group, each holding its dim-0 shard of every tensor as a DTensor,
which DCP stores as one chunk per rank and tensor, as ours cuts them. Loads, as ours, new tensors, one rank
after another, in one process: rank 0's whole model by DCP's single-process mode; a rank's dim-0 shards by the
reads DCP plans for a DTensor rank holding them (its own resharding; only the exchange of plans between ranks
is left out). Without torch the bench says so in one line and prints no DCP column.

    .venv/bin/python bench/checkpoint.py [--gib 1] [--repeat 5] [--dir /tmp] [--memory-dir /dev/shm]
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import multiprocessing
import multiprocessing.synchronize
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.queues import SimpleQueue
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.snapshots import CheckpointPersister, Outbox  # noqa: E402
from common.clock import SystemClock  # noqa: E402
from trainer.checkpoint import CheckpointMeta, CheckpointWriter, load_checkpoint  # noqa: E402
from trainer.checkpoint.parallel_copy import COPY_THREADS, ParallelCopier  # noqa: E402
from trainer.checkpoint.sharding import split_extent  # noqa: E402
from trainer.runtime.agent_saves import AgentSaves  # noqa: E402

try:  # the `bench` extra (pyproject.toml): CPU torch, for the DCP baseline only
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    # DCP's single-process mode is meant here (rank 0's whole-model load, the planner below); it warns on every call.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
except ImportError:
    torch = None

BLOCK = 16 << 20
GB = 1e9


def make_model(gib: float) -> tuple[dict[str, np.ndarray], mmap.mmap]:
    """Page-aligned tensors (one anonymous mapping) so O_DIRECT can write them without a copy."""
    big = max(1, round(gib * 16))
    shapes: dict[str, tuple[int, ...]] = {f"layer{i}.weight": (4096, 4096) for i in range(big)}
    shapes.update({f"layer{i}.bias": (4096,) for i in range(big)})
    sizes = {name: int(np.prod(shape)) * 4 for name, shape in shapes.items()}
    arena = mmap.mmap(-1, sum(sizes.values()))
    rng = np.random.default_rng(0)
    tensors, offset = {}, 0
    for name, shape in shapes.items():
        array = np.frombuffer(arena, np.float32, sizes[name] // 4, offset).reshape(shape)
        rng.random(out=array.reshape(-1), dtype=np.float32)
        tensors[name] = array
        offset += sizes[name]
    return tensors, arena


def warm_up_memory(nbytes: int) -> float:
    """Touches `nbytes` of memory once; returns GB/s. A fresh VM pays its hypervisor for the first touch of
    every page, which would otherwise land on whichever measurement happens to get fresh pages.
    """
    started = time.perf_counter()
    np.ones(nbytes, np.uint8)
    return nbytes / (time.perf_counter() - started) / GB


def byte_views(arrays: Iterable[np.ndarray]) -> list[memoryview]:
    return [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays]


def raw_write(path: Path, arrays: list[np.ndarray], direct: bool) -> float:
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    for data in byte_views(arrays):
        for start in range(0, len(data), BLOCK):
            block = data[start : start + BLOCK]
            while block:
                block = block[os.write(fd, block) :]
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - started


def evict(paths: Iterable[Path]) -> None:
    """Drops the files' (clean, fsynced) pages from the page cache so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def raw_read(paths: list[Path], direct: bool) -> float:
    evict(paths)
    buffer = mmap.mmap(-1, BLOCK)
    started = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        while os.readv(fd, [buffer]) == BLOCK:
            pass
        os.close(fd)
    return time.perf_counter() - started


def raw_read_into_new_array(paths: list[Path]) -> float:
    """The files read with 4 threads, 4 MiB at a time, into one new array of their total size."""
    evict(paths)
    started = time.perf_counter()
    sizes = [p.stat().st_size for p in paths]
    target = np.empty(sum(sizes), np.uint8)
    jobs, base = [], 0
    for path, size in zip(paths, sizes):
        fd = os.open(path, os.O_RDONLY)
        jobs += [(fd, offset, base + offset, min(4 << 20, size - offset)) for offset in range(0, size, 4 << 20)]
        base += size
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda j: os.preadv(j[0], [memoryview(target[j[2] : j[2] + j[3]])], j[1]), jobs))
    for fd in {job[0] for job in jobs}:
        os.close(fd)
    return time.perf_counter() - started


def save_job(root: Path, tensors: dict[str, np.ndarray], writers: list[CheckpointWriter], step: int) -> float:
    """One synchronous save by every rank at once, as a job does; seconds until rank 0 committed."""
    started = time.perf_counter()
    for writer in writers:
        writer.save_async(CheckpointMeta(step, step, 0), tensors)
    for writer in writers:
        writer.wait()
    return time.perf_counter() - started


def data_files(step_dir: Path) -> list[Path]:
    return sorted(step_dir.glob("rank_*.safetensors"))


def timed_load(step_dir: Path, rank: int, world_size: int, shard_dims: dict[str, int] | None) -> tuple[float, int]:
    evict(data_files(step_dir))
    started = time.perf_counter()
    tensors, _ = load_checkpoint(step_dir, rank, world_size, shard_dims)
    return time.perf_counter() - started, sum(a.nbytes for a in tensors.values())


def dcp_files(root: Path) -> list[Path]:
    return sorted(root.iterdir())  # the ranks' .distcp files and the coordinator's .metadata


def dcp_save(root: Path, tensors: dict[str, np.ndarray], world_size: int) -> float:
    """A DCP save of the same tensors (torch.from_numpy, no copy); seconds until every rank has returned.

    One rank: DCP's single-process mode (no process group), every tensor whole. More ranks: that many forked
    processes in a real gloo group, each holding its dim-0 shard of every tensor as a DTensor (Shard(0); the
    world size must divide dim 0), timed by rank 0 from a barrier to a barrier after the save.
    """
    if world_size == 1:
        state = {name: torch.from_numpy(array) for name, array in tensors.items()}
        started = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(root))
        return time.perf_counter() - started
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("fork")  # the children share the tensors' anonymous mapping
    results = context.SimpleQueue()
    ranks = [
        context.Process(target=_dcp_save_rank, args=(root, tensors, rank, world_size, port, results))
        for rank in range(world_size)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=600)  # a rank that died leaves the others waiting in a collective
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    if any(process.exitcode for process in ranks):
        raise RuntimeError(f"a DCP save rank failed: exit codes {[process.exitcode for process in ranks]}")
    seconds: float = results.get()
    return seconds


def _dcp_save_rank(
    root: Path, tensors: dict[str, np.ndarray], rank: int, world_size: int, port: int, results: SimpleQueue[float]
) -> None:
    # As DataLoader workers do: the parent's OpenMP threads did not survive the fork, and a parallel region in the
    # child would wait for them forever.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    state = {}
    for name, array in tensors.items():
        start, size = split_extent(array.shape[0], world_size, rank)
        whole = torch.from_numpy(array)
        state[name] = DTensor.from_local(
            whole[start : start + size], mesh, [Shard(0)], shape=whole.shape, stride=whole.stride()
        )
    dist.barrier()
    started = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(root))
    dist.barrier()
    if rank == 0:
        results.put(time.perf_counter() - started)
    dist.destroy_process_group()


if torch is not None:

    class Dim0ShardPlanner(DefaultLoadPlanner):
        """The reads a rank holding dim-0 shards as DTensors gets from DCP, planned in one process (DCP's
        single-process mode, no process group): DCP's own resharding (create_read_items_for_chunk_list) for the
        chunk of each tensor that starts at row `starts[name]`. Only the exchange of plans between ranks is left
        out; what is read, and how, is DCP's.
        """

        def __init__(self, starts: dict[str, int]) -> None:
            super().__init__()
            self.starts = starts

        def create_local_plan(self) -> LoadPlan:
            items = []
            for name, shard in self.state_dict.items():
                offsets = torch.Size((self.starts[name],) + (0,) * (shard.dim() - 1))
                chunk = ChunkStorageMetadata(offsets=offsets, sizes=shard.size())
                items += create_read_items_for_chunk_list(name, self.metadata.state_dict_metadata[name], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
            return self.state_dict[index.fqn]


def dcp_timed_load(
    root: Path, tensors: dict[str, np.ndarray], rank: int, world_size: int, sharded: bool
) -> tuple[float, dict[str, np.ndarray]]:
    """Like timed_load, through DCP: new tensors, whole or this rank's dim-0 part, filled by dcp.load."""
    evict(dcp_files(root))
    started = time.perf_counter()
    state, starts = {}, {}
    for name, array in tensors.items():
        start, size = split_extent(array.shape[0], world_size, rank) if sharded else (0, array.shape[0])
        starts[name] = start
        state[name] = torch.empty((size, *array.shape[1:]), dtype=torch.from_numpy(array[:0]).dtype)
    planner = Dim0ShardPlanner(starts) if sharded else None
    dcp.load(state, storage_reader=dcp.FileSystemReader(root), planner=planner)
    seconds = time.perf_counter() - started
    return seconds, {name: tensor.numpy() for name, tensor in state.items()}


def same_bytes(loaded: dict[str, np.ndarray], tensors: dict[str, np.ndarray], rank: int, world_size: int) -> bool:
    """Whether `loaded` is bit for bit rank `rank`'s dim-0 part of `tensors` (world_size 1: the whole)."""
    for name, array in tensors.items():
        start, size = split_extent(array.shape[0], world_size, rank)
        if loaded[name].view(np.uint32).tobytes() != array[start : start + size].view(np.uint32).tobytes():
            return False
    return True


def copy_rate(tensors: dict[str, np.ndarray], threads: int, repeat: int = 5) -> float:
    """GB/s of copying every tensor into buffers of its own, reused (as a save's host buffers are), on
    `threads` threads (trainer/checkpoint/parallel_copy.py); the median of `repeat` after one untimed."""
    pairs = [(np.empty_like(array), array) for array in tensors.values()]
    copier = ParallelCopier(threads)
    try:
        copier.copy(pairs)
        seconds = []
        for _ in range(repeat):
            started = time.perf_counter()
            copier.copy(pairs)
            seconds.append(time.perf_counter() - started)
    finally:
        copier.close()
    return sum(array.nbytes for array in tensors.values()) / statistics.median(seconds) / 1e9


def checksum_rates() -> str:
    data = memoryview(np.random.default_rng(1).bytes(256 << 20))
    functions = {
        "crc32": zlib.crc32,
        "sha256": lambda block: hashlib.sha256(block).digest(),
        "blake2b": lambda block: hashlib.blake2b(block).digest(),
    }
    rates = []
    for name, function in functions.items():
        started = time.perf_counter()
        for start in range(0, len(data), BLOCK):
            function(data[start : start + BLOCK])
        rates.append(f"{name} {len(data) / (time.perf_counter() - started) / GB:.2f} GB/s")
    return ", ".join(rates)


def rate(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / GB


def faster(rates: dict[str, float]) -> tuple[float, str]:
    name = max(rates, key=lambda k: rates[k])
    return rates[name], f"{name} ({', '.join(f'{k} {v:.2f}' for k, v in rates.items())})"


class Report:
    def __init__(self, with_dcp: bool) -> None:
        self.with_dcp = with_dcp
        self.rows: list[str] = []

    def add(
        self, what: str, ours: float, raw: tuple[float, str], new_arrays: float | None = None, dcp: float | None = None
    ) -> None:
        versus_dcp = f"{dcp:6.2f} {ours / dcp:6.2f} " if self.with_dcp and dcp is not None else ""
        extra = "" if new_arrays is None else f"{new_arrays:8.2f} {ours / new_arrays:6.2f}"
        self.rows.append(f"{what:36} {ours:6.2f} {versus_dcp}{raw[0]:7.2f} {ours / raw[0]:6.2f} {extra:15}  {raw[1]}")

    def print(self) -> None:
        versus_dcp = f"{'dcp':>6} {'ratio':>6} " if self.with_dcp else ""
        columns = f"{'ours':>6} {versus_dcp}{'dd-raw':>7} {'ratio':>6} {'new-arr':>8} {'ratio':>6}"
        print(f"{'GB/s (medians)':36} {columns}  dd-raw = faster of")
        for row in self.rows:
            print(row)


def measure_saves(work: Path, tensors: dict[str, np.ndarray], repeat: int, report: Report) -> float:
    """Returns the median synchronous save time at one rank."""
    arrays = list(tensors.values())
    payload = sum(a.nbytes for a in arrays)
    raw_file = work / "raw.bin"
    raw: dict[str, list[float]] = {"buffered+fsync": [], "O_DIRECT": []}
    ours: dict[int, list[float]] = {1: [], 2: []}
    theirs: dict[int, list[float]] = {1: [], 2: []}
    # keep: no retention inside the timed saves (it runs after the commit, in the background, anyway).
    jobs = {n: [CheckpointWriter(work / f"save{n}", r, n, keep=repeat + 2) for r in range(n)] for n in ours}
    for n, writers in jobs.items():
        save_job(work / f"save{n}", tensors, writers, step=1)
        if report.with_dcp:
            timed_dcp_save(work / f"dcp-save{n}", tensors, n)
    for i in range(repeat):
        raw["buffered+fsync"].append(raw_write(raw_file, arrays, direct=False))
        raw["O_DIRECT"].append(raw_write(raw_file, arrays, direct=True))
        for n, writers in jobs.items():
            ours[n].append(save_job(work / f"save{n}", tensors, writers, step=i + 2))
            if report.with_dcp:
                theirs[n].append(timed_dcp_save(work / f"dcp-save{n}", tensors, n))
    baseline = faster({k: rate(payload, v) for k, v in raw.items()})
    for n in ours:
        dcp_rate = rate(payload, theirs[n]) if report.with_dcp else None
        report.add(f"save, {n} rank{'s' if n > 1 else ''} writing", rate(payload, ours[n]), baseline, dcp=dcp_rate)
    for n, writers in jobs.items():
        for writer in writers:
            writer.close()
        shutil.rmtree(work / f"save{n}")
    raw_file.unlink()
    return statistics.median(ours[1])


def timed_dcp_save(root: Path, tensors: dict[str, np.ndarray], world_size: int) -> float:
    """One DCP save into a new directory (as each of ours goes to a new step directory), removed afterwards."""
    seconds = dcp_save(root, tensors, world_size)
    shutil.rmtree(root)
    return seconds


def measure_async(root: Path, tensors: dict[str, np.ndarray], repeat: int, keep: int | None = None,
                  copy_threads: tuple[int, ...] = (COPY_THREADS,)) -> dict[int, tuple[float, float, float]]:
    """How long save_async blocks: the first save (new host buffers), then the median of later ones; and
    the median time until the save committed (in the background). `keep`: retention (default: none).
    One writer per number of `copy_threads` copying into its host buffers (1: the copy before
    trainer/checkpoint/parallel_copy.py), their saves taken in turn so that the machine's drift falls on
    each alike; the figures by number of threads."""
    copy_threads = tuple(dict.fromkeys(copy_threads))  # (COPY_THREADS, 1) on one core is one writer
    writers = {n: CheckpointWriter(root / f"threads{n}", 0, 1, keep=keep or repeat + 2, copy_threads=n)
               for n in copy_threads}
    blocked: dict[int, list[float]] = {n: [] for n in copy_threads}
    committed: dict[int, list[float]] = {n: [] for n in copy_threads}
    try:
        for step in range(1, repeat + 2):
            for n, writer in writers.items():
                started = time.perf_counter()
                writer.save_async(CheckpointMeta(step, step, 0), tensors)
                blocked[n].append(time.perf_counter() - started)
                writer.wait()
                committed[n].append(time.perf_counter() - started)
    finally:
        for writer in writers.values():
            writer.close()
        shutil.rmtree(root)
    return {n: (blocked[n][0], statistics.median(blocked[n][1:]), statistics.median(committed[n][1:]))
            for n in copy_threads}


def _agent_persister(outbox: Path, checkpoints: Path, keep: int, committed: SimpleQueue[int],
                     stop: multiprocessing.synchronize.Event) -> None:
    """The agent's side of `checkpoint.saved_by: agent`, in a process of its own as on a host."""
    persister = CheckpointPersister(Outbox(outbox, checkpoints, (0,), 1, 0, keep),
                                    lambda saved: committed.put(saved.step),
                                    lambda failed: committed.put(-failed.step))
    persister.start()
    stop.wait()
    persister.stop()


def measure_agent_saves(outbox: Path, checkpoints: Path, tensors: dict[str, np.ndarray], repeat: int,
                        snapshots: Path | None = None, from_snapshot: bool = True) -> tuple[float, float, float]:
    """As `measure_async`, with the agent saving (agent/snapshots/checkpoint_persister.py in another process): how long
    a rank's hand-over to the outbox blocks the step, first and then the median; and the median time until
    the agent had copied, verified and committed it on disk. With `snapshots`, every save step is also an
    in-memory snapshot step (retention keeps 1, as the workers'): the agent's share is the snapshot's file,
    linked into the outbox, or, not `from_snapshot`, a second copy handed over after the snapshot's."""
    context = multiprocessing.get_context("fork")
    committed: SimpleQueue[int] = context.SimpleQueue()
    stop = context.Event()
    outbox.mkdir(parents=True)
    agent = context.Process(target=_agent_persister, args=(outbox, checkpoints, repeat + 2, committed, stop))
    agent.start()
    blocked, saved = [], []
    saves = AgentSaves(outbox, 0, 1, 0, "bench", SystemClock())
    snapshot_writer = None if snapshots is None else CheckpointWriter(snapshots, 0, 1, keep=1)
    try:
        for step in range(1, repeat + 2):
            started = time.perf_counter()
            meta = CheckpointMeta(step, step, 0)
            if snapshot_writer is None:
                saves.save(meta, tensors, {})
            elif from_snapshot:
                saves.settle()
                snapshot_writer.wait()
                saves.hand_over_snapshot(step, snapshot_writer.save_async(meta, tensors, share_into=outbox))
            else:
                snapshot_writer.wait()
                snapshot_writer.save_async(meta, tensors)
                saves.save(meta, tensors, {})
            blocked.append(time.perf_counter() - started)
            if committed.get() != step:
                raise RuntimeError(f"the agent did not save step {step}")
            saved.append(time.perf_counter() - started)
        saves.close()
    finally:
        if snapshot_writer is not None:
            snapshot_writer.close()
        stop.set()
        agent.join()
        shutil.rmtree(outbox, ignore_errors=True)
        shutil.rmtree(checkpoints, ignore_errors=True)
        if snapshots is not None:
            shutil.rmtree(snapshots, ignore_errors=True)
    return blocked[0], statistics.median(blocked[1:]), statistics.median(saved[1:])


def measure_load(
    work: Path, tensors: dict[str, np.ndarray], source: int, target: int, repeat: int, report: Report
) -> None:
    payload = sum(a.nbytes for a in tensors.values())
    root = work / f"load{source}"
    writers = [CheckpointWriter(root, r, source) for r in range(source)]
    save_job(root, tensors, writers, step=1)
    for writer in writers:
        writer.close()
    step_dir = root / "step_00000001"
    files = data_files(step_dir)
    shard_dims = {name: 0 for name in tensors}
    raw: dict[str, list[float]] = {"buffered": [], "O_DIRECT": []}
    new_arrays: list[float] = []
    whole: list[float] = []
    sharded: list[float] = []
    dcp_whole: list[float] = []
    dcp_sharded: list[float] = []
    check, _ = load_checkpoint(step_dir, target - 1, target)
    assert all(check[k].view(np.uint32).tobytes() == v.view(np.uint32).tobytes() for k, v in tensors.items())
    del check
    dcp_root = work / f"dcp-load{source}"
    if report.with_dcp:
        dcp_save(dcp_root, tensors, source)
        last = target - 1
        assert same_bytes(dcp_timed_load(dcp_root, tensors, 0, target, sharded=False)[1], tensors, 0, 1)
        assert same_bytes(dcp_timed_load(dcp_root, tensors, last, target, sharded=True)[1], tensors, last, target)
    for _ in range(repeat):
        raw["buffered"].append(raw_read(files, direct=False))
        raw["O_DIRECT"].append(raw_read(files, direct=True))
        new_arrays.append(raw_read_into_new_array(files))
        seconds, loaded = timed_load(step_dir, 0, target, None)
        assert loaded == payload
        whole.append(seconds)
        per_rank = [timed_load(step_dir, r, target, shard_dims) for r in range(target)]
        assert sum(n for _, n in per_rank) == payload
        sharded.append(sum(s for s, _ in per_rank))
        if report.with_dcp:
            dcp_whole.append(dcp_timed_load(dcp_root, tensors, 0, target, sharded=False)[0])
            per_rank_dcp = [dcp_timed_load(dcp_root, tensors, r, target, sharded=True)[0] for r in range(target)]
            dcp_sharded.append(sum(per_rank_dcp))
    baseline = faster({k: rate(payload, v) for k, v in raw.items()})
    fresh = rate(payload, new_arrays)
    theirs = (rate(payload, dcp_whole), rate(payload, dcp_sharded)) if report.with_dcp else (None, None)
    report.add(f"load {source}->{target}, rank 0 whole model", rate(payload, whole), baseline, fresh, theirs[0])
    report.add(f"load {source}->{target}, dim-0 shards, all ranks", rate(payload, sharded), baseline, fresh, theirs[1])
    shutil.rmtree(root)
    shutil.rmtree(dcp_root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="model size")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions of each measurement")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write")
    parser.add_argument("--memory-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for the snapshots")
    args = parser.parse_args()

    tensors, _arena = make_model(args.gib)
    payload = sum(a.nbytes for a in tensors.values())
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    memory = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.memory_dir))
    print(f"payload {payload / (1 << 30):.2f} GiB in {len(tensors)} tensors, under {work}, "
          f"{os.cpu_count()} cores, medians of {args.repeat}")
    touched = warm_up_memory(4 * payload)
    print(f"warm-up: first touch of {4 * payload / (1 << 30):.0f} GiB of memory at {touched:.2f} GB/s")
    print(f"checksum speed, one core: {checksum_rates()} -> segments use crc32, files sha256 of header + crc32s")
    print(f"copy into reused host buffers (what blocks the step): {copy_rate(tensors, 1):.1f} GB/s on one thread, "
          f"{copy_rate(tensors, COPY_THREADS):.1f} GB/s on {COPY_THREADS}")
    report = Report(with_dcp=torch is not None)
    if torch is None:
        print("DCP baseline: torch is not installed (pip install -e '.[bench]'), so no DCP column")
    else:
        print(f"DCP baseline: torch {torch.__version__} torch.distributed.checkpoint, default FileSystemWriter/Reader")
    try:
        sync_save = measure_saves(work, tensors, args.repeat, report)
        first, steady, async_committed = measure_async(work / "async", tensors, args.repeat)[COPY_THREADS]
        agent_first, agent_steady, agent_committed = measure_agent_saves(
            memory / "outbox", work / "agent-saved", tensors, args.repeat)
        both = {from_snapshot: measure_agent_saves(memory / "outbox", work / "agent-saved", tensors, args.repeat,
                                                   snapshots=memory / "agent-snapshots", from_snapshot=from_snapshot)
                for from_snapshot in (False, True)}
        # As the workers take them: retention keeps 1 (MEMORY_KEEP), the tmpfs holds at most 2 copies.
        snapshots = measure_async(memory / "snapshots", tensors, args.repeat, 1, copy_threads=(COPY_THREADS, 1))
        (memory_first, memory_steady, memory_committed), one_thread_steady = snapshots[COPY_THREADS], snapshots[1][1]
        for source, target in ((2, 3), (4, 2)):
            measure_load(work, tensors, source, target, args.repeat, report)
        report.print()
        print(
            f"async save blocks the step: first save {first * 1e3:.0f} ms (allocates its host buffers), then "
            f"{steady * 1e3:.0f} ms = {steady / sync_save:.1%} of a synchronous save ({sync_save * 1e3:.0f} ms)"
        )
        print(
            f"saved by the agent (checkpoint.saved_by: agent) blocks the step: first {agent_first * 1e3:.0f} ms, "
            f"then {agent_steady * 1e3:.0f} ms = {agent_steady / sync_save:.1%} of a synchronous save; on disk, "
            f"verified and committed by the agent {agent_committed * 1e3:.0f} ms after it began (the async save "
            f"by the worker: {async_committed * 1e3:.0f} ms)"
        )
        (copies_first, copies_steady, copies_committed), (from_first, from_steady, from_committed) = (
            both[False], both[True])
        print(
            f"a step both snapshotted and saved by the agent (saved_by: agent, snapshots on) blocks: taken from "
            f"the snapshot (its file linked into the outbox) first {from_first * 1e3:.0f} ms, then "
            f"{from_steady * 1e3:.0f} ms = {from_steady / sync_save:.1%} of a synchronous save, on disk "
            f"{from_committed * 1e3:.0f} ms after it began; as two copies (the snapshot, then the hand-over) first "
            f"{copies_first * 1e3:.0f} ms, then {copies_steady * 1e3:.0f} ms = {copies_steady / sync_save:.1%}, on "
            f"disk {copies_committed * 1e3:.0f} ms after it began"
        )
        print(
            f"in-memory snapshot ({memory}) blocks the step: first {memory_first * 1e3:.0f} ms, then "
            f"{memory_steady * 1e3:.0f} ms = {memory_steady / sync_save:.1%} of a synchronous save; "
            f"committed in the background {memory_committed * 1e3:.0f} ms after it began; copying on one thread "
            f"instead of {COPY_THREADS}: {one_thread_steady * 1e3:.0f} ms = {one_thread_steady / sync_save:.1%}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)


if __name__ == "__main__":
    main()
