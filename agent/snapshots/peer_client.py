"""The agent's side of SnapshotPeer as a client: list another agent's pinned snapshots and fetch a rank's
files of one (agent/snapshots/peer_service.py serves them).

With TLS the holder must present the node certificate of the node it is named as (its DNS name
NODE.node.trainerd, checked through `grpc.ssl_target_name_override`), so an agent cannot serve as another. A rank's
report comes first and says how many bytes its data file has: no more are written, and the rank counts
only once both files are in place, the report last. The digest of the data is checked when the ranks are
assembled into a checkpoint (`MemorySnapshotDir.assemble`, which reads every byte).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import grpc

from agent.commands import PeerAgent
from agent.snapshots.memory_snapshots import PARTIAL, SnapshotAssemblyError
from agent.snapshots.peer_service import CHUNK_BYTES
from agent.snapshots.snapshot_reports import read_report, report_mismatch
from common.cert_identity import node_server_name
from common.tls_files import TlsFiles
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from trainer.checkpoint.commit import RankReport, report_name
from trainer.checkpoint.errors import CorruptCheckpoint
from trainer.checkpoint.json_fields import MAX_JSON_BYTES
from trainer.checkpoint.rank_file import rank_file_name

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class NotServedYet(SnapshotAssemblyError):
    """The holder does not serve this node: its newest Launch named another generation's nodes (the Launch of
    this one may not have reached it yet)."""


class PeerClient:
    """One channel per holder, kept until `close`; `tls`: this agent's node certificate (None: plain)."""

    def __init__(self, tls: TlsFiles | None) -> None:
        self._tls = tls
        self._channels: dict[tuple[str, str], grpc.Channel] = {}
        self._lock = threading.Lock()
        self._closed = False

    def clone(self) -> PeerClient:
        """A client with the same credentials and channels of its own: closing it ends only its calls."""
        return PeerClient(self._tls)

    def list_snapshots(self, holder: PeerAgent, job: str, timeout_s: float, newer_than_step: int = 0,
                       wait_s: float = 0.0) -> list[pb.MemorySnapshot]:
        """The snapshots `holder` has pinned of `job`, newest first; with `wait_s`, once one is newer than
        `newer_than_step` or that long has passed (a holder older than the long poll answers at once).
        SnapshotAssemblyError when it cannot say."""
        request = pb.PeerListRequest(job_name=job, newer_than_step=newer_than_step, wait_s=wait_s)
        try:
            reply = self._stub(holder).ListSnapshots(request, timeout=timeout_s + wait_s)
        except grpc.RpcError as exc:
            raise SnapshotAssemblyError(f"cannot list the snapshots of node {holder.node} ({holder.address}): "
                                        f"{_status(exc)}") from None
        return list(reply.own)

    def fetch_rank(self, holder: PeerAgent, job: str, step: int, rank: int, dest_dir: Path,
                   timeout_s: float, max_data_bytes: int | None = None) -> None:
        """Write `rank`'s data file and report of `step`, as `holder` has them, into `dest_dir`; each call
        may take `timeout_s`, and a data file larger than `max_data_bytes` is not fetched.
        SnapshotAssemblyError (one line) when they cannot be fetched whole; then neither file is left."""
        where = f"rank {rank} of step {step} from node {holder.node} ({holder.address})"

        def request(kind: pb.PeerFileKind) -> pb.PeerFetchRequest:
            return pb.PeerFetchRequest(job_name=job, step=step, rank=rank, kind=kind)

        written = [dest_dir / name for name in (rank_file_name(rank), report_name(rank))]
        written += [path.with_name(path.name + PARTIAL) for path in written]
        try:
            report_bytes = b"".join(self._fetch(holder, request(pb.PEER_FILE_REPORT), timeout_s, MAX_JSON_BYTES))
            report = _parse_report(report_bytes, rank, step)
            if max_data_bytes is not None and report.file.size > max_data_bytes:
                raise SnapshotAssemblyError(f"its data file has {report.file.size} bytes, more than the "
                                            f"{max_data_bytes} there is room for")
            _write(dest_dir, rank_file_name(rank), report.file.size,
                   self._fetch(holder, request(pb.PEER_FILE_DATA), timeout_s, report.file.size))
            _write(dest_dir, report_name(rank), len(report_bytes), [report_bytes])
            if read_report(dest_dir, rank, step) is None:
                raise SnapshotAssemblyError("its files are not whole once written")
        except grpc.RpcError as exc:
            _unlink(written)
            error = NotServedYet if exc.code() is grpc.StatusCode.FAILED_PRECONDITION else SnapshotAssemblyError
            raise error(f"cannot fetch {where}: {_status(exc)}") from None
        except (SnapshotAssemblyError, OSError) as exc:
            _unlink(written)
            raise SnapshotAssemblyError(f"cannot fetch {where}: {exc}") from None

    def close(self) -> None:
        """Close every channel, which ends the calls under way on them; no call is made after."""
        with self._lock:
            self._closed = True
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def _fetch(self, holder: PeerAgent, request: pb.PeerFetchRequest, timeout_s: float,
               limit: int) -> Iterable[bytes]:
        """The file's bytes as they come, refused past `limit`."""
        received = 0
        for chunk in self._stub(holder).FetchFile(request, timeout=timeout_s):
            received += len(chunk.data)
            if received > limit:
                what = "the report" if request.kind == pb.PEER_FILE_REPORT else "the data file"
                raise SnapshotAssemblyError(f"{what} sent more than {limit} bytes")
            yield chunk.data

    def _stub(self, holder: PeerAgent) -> pb_grpc.SnapshotPeerStub:
        key = (holder.address, holder.node)
        with self._lock:
            if self._closed:
                raise SnapshotAssemblyError("the peer client is closed")
            channel = self._channels.get(key)
            if channel is None:
                options: list[tuple[str, str | int]] = [("grpc.max_receive_message_length", CHUNK_BYTES + 1024)]
                if self._tls is None:
                    channel = grpc.insecure_channel(holder.address, options=options)
                else:
                    options.append(("grpc.ssl_target_name_override", node_server_name(holder.node)))
                    channel = grpc.secure_channel(holder.address, self._tls.channel_credentials(), options=options)
                self._channels[key] = channel
        return pb_grpc.SnapshotPeerStub(channel)


def _parse_report(data: bytes, rank: int, step: int) -> RankReport:
    where = f"{report_name(rank)} of step {step}"
    try:
        report = RankReport.from_json(json.loads(data), where)
    except (ValueError, AttributeError, CorruptCheckpoint) as exc:
        raise SnapshotAssemblyError(f"its report cannot be read: {exc}") from None
    mismatch = report_mismatch(report, rank, step)
    if mismatch:
        raise SnapshotAssemblyError(mismatch)
    return report


def _write(directory: Path, name: str, size: int, chunks: Iterable[bytes]) -> None:
    """`name` in `directory`, exactly `size` bytes (`chunks` refuses more): written under a new `.partial`
    name, then renamed."""
    partial = directory / (name + PARTIAL)
    written = 0
    with os.fdopen(os.open(partial, _NEW_FILE, 0o644), "wb") as f:
        for chunk in chunks:
            written += len(chunk)
            f.write(chunk)
    if written != size:
        raise SnapshotAssemblyError(f"{name} ended after {written} of the {size} bytes its report says")
    partial.rename(directory / name)


def _unlink(paths: Iterable[Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # what is left is a partial file of a directory the caller discards


def _status(exc: grpc.RpcError) -> str:
    code, details = exc.code(), exc.details()  # type: ignore[attr-defined]  # a call's error is also a Call
    return f"{code.name if code else 'UNKNOWN'}: {(details or '').replace(chr(10), ' ')}"
