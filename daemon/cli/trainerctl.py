"""`trainerctl`: see and steer a trainerd cluster.

Exit codes: 0 success, 1 the operation failed (or this certificate may not do it), 2 usage or config
error, 3 coordinator unreachable (a refused TLS handshake included).
"""

from __future__ import annotations

# Before anything imports grpc (sorting imports once put `import grpc` above it, and gRPC's core then
# logged a refused TLS handshake at INFO beside trainerctl's one-line error).
from daemon.cli import quiet_grpc  # noqa: F401

# isort: split
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass

import click
import grpc
from rich.console import Console
from rich.table import Table

from common.config_file import ConfigError, parse_host_port
from common.peer_text import escaped
from common.tls_files import (
    TLS_ENV,
    TLS_OPTION_NAMES,
    TlsFiles,
    read_tls_files,
    tls_settings_from_options,
    unnamed_address_hint,
)
from daemon.cli.command_groups import PointingGroup
from daemon.cli.status_json import COST_PARTS, GOODPUT_PHASES, RECOVERY_PHASES, event_to_json, status_to_json
from daemon.events import EVENTS_PAGE
from proto import trainerd_pb2 as pb
from proto import trainerd_pb2_grpc as pb_grpc
from proto.launch_env import COORDINATOR_ENV
from proto.vocabulary import LEADER_ADDRESS_METADATA

EXIT_UNREACHABLE = 3
RPC_TIMEOUT_S = 5.0
# A log read waits for the rank's agent (daemon/log_relay.py gives it LOG_READ_TIMEOUT_S): the call must
# outlast that wait, so that a slow agent is reported as such and not as an unreachable coordinator.
LOG_RPC_TIMEOUT_S = 15.0
FOLLOW_POLL_S = 1.0
LOG_CHUNK_BYTES = 1 << 20
TAIL_BYTES_PER_LINE = 1024
TAIL_MIN_BYTES = 64 << 10


class Unreachable(click.ClickException):
    exit_code = EXIT_UNREACHABLE


# How a failed TLS handshake looks from the client: a closed socket (the other side refused it) or the
# handshake's own error.
_TLS_MISMATCH_SIGNS = ("socket closed", "handshake")


class OptionProblem(click.ClickException):
    """A global option is wrong (a TLS file missing, unreadable, or given without the other two)."""

    exit_code = 2


@dataclass(frozen=True)
class GlobalOptions:
    """What the options before the command say; checked only by a command that calls the coordinator."""

    coordinator: str | None
    cacert: str | None
    cert: str | None
    key: str | None


@dataclass(frozen=True)
class Coordinators:
    """The coordinators to try, in order, and the TLS files to call them with (None: plain text)."""

    addresses: list[str]
    tls: TlsFiles | None

    def channel(self, address: str) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, self.tls.channel_credentials())

    def unreachable(self, errors: list[str]) -> Unreachable:
        """Unreachable, with a hint when the connection failed the way a TLS mismatch does."""
        return Unreachable("cannot reach the coordinator (" + "; ".join(errors) + ")" + self._tls_hint(errors))

    def _tls_hint(self, errors: list[str]) -> str:
        text = " ".join(errors).lower()
        unnamed = [hint for error in errors if (hint := unnamed_address_hint(error.split(": ", 1)[0], error))]
        if self.tls and unnamed:
            return f"; {unnamed[0]}"
        if self.tls and "certificate_verify_failed" in text:
            return "; the coordinator's certificate is not one the CA in --cacert signed for this address"
        if not any(sign in text for sign in _TLS_MISMATCH_SIGNS):
            return ""
        if self.tls:
            return "; the coordinator may have refused this certificate: is it signed by the cluster's CA?"
        return "; if the coordinator serves TLS, pass --cacert, --cert and --key"


def _coordinators(options: GlobalOptions) -> Coordinators:
    addresses = _addresses(options.coordinator)
    try:
        settings = tls_settings_from_options(options.cacert, options.cert, options.key)
        tls = None if settings is None else read_tls_files(settings, "trainerctl", TLS_OPTION_NAMES)
    except ConfigError as exc:
        raise OptionProblem(str(exc)) from exc
    return Coordinators(addresses, tls)


def _addresses(option: str | None) -> list[str]:
    raw = option or os.environ.get(COORDINATOR_ENV)
    if not raw:
        raise click.UsageError(f"name the coordinator with --coordinator HOST:PORT or {COORDINATOR_ENV}")
    addresses = [a.strip() for a in raw.split(",") if a.strip()]
    for address in addresses:
        try:
            parse_host_port(address)
        except ValueError as exc:
            raise click.UsageError(f"--coordinator: {exc}") from exc
    return addresses


def _get_status(coordinators: Coordinators, address: str) -> pb.StatusReply:
    with coordinators.channel(address) as channel:
        return pb_grpc.ControlStub(channel).GetStatus(pb.StatusRequest(), timeout=RPC_TIMEOUT_S)


def fetch_status(coordinators: Coordinators) -> tuple[str, pb.StatusReply]:
    """Ask the first coordinator that answers; when it is a standby, prefer the leader's answer. A refused
    certificate ends the search: every coordinator of the cluster refuses it alike."""
    errors = []
    for address in coordinators.addresses:
        try:
            reply = _get_status(coordinators, address)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise click.ClickException(exc.details() or exc.code().name) from exc
            errors.append(f"{address}: {exc.code().name} {exc.details() or ''}".strip())
            continue
        leader = reply.coordinator.leader_address
        if not reply.coordinator.is_leader and leader and leader != address:
            try:
                return leader, _get_status(coordinators, leader)
            except grpc.RpcError:
                pass
        return address, reply
    raise coordinators.unreachable(errors)


def _call(coordinators: Coordinators, address: str, method: str, request, timeout: float = RPC_TIMEOUT_S):
    with coordinators.channel(address) as channel:
        return getattr(pb_grpc.ControlStub(channel), method)(request, timeout=timeout)


def _named_leader(exc: grpc.RpcError) -> str | None:
    """The leader's address a standby attaches to UNAVAILABLE, if it knows one."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    return dict(exc.trailing_metadata() or ()).get(LEADER_ADDRESS_METADATA) or None


def _failed(coordinators: Coordinators, address: str, exc: grpc.RpcError) -> click.ClickException:
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return coordinators.unreachable([f"{address}: {exc.code().name} {exc.details() or ''}".strip()])
    return click.ClickException(exc.details() or exc.code().name)


def call_control(coordinators: Coordinators, method: str, request, timeout: float = RPC_TIMEOUT_S):
    """Call a Control method on the leader (found through status), or the first coordinator that answers.

    When leadership moved since the status, the standby answers UNAVAILABLE naming the new leader:
    the call follows it once."""
    address, _ = fetch_status(coordinators)
    try:
        return _call(coordinators, address, method, request, timeout)
    except grpc.RpcError as exc:
        leader = _named_leader(exc)
        if leader is None or leader == address:
            raise _failed(coordinators, address, exc) from exc
    try:
        return _call(coordinators, leader, method, request, timeout)
    except grpc.RpcError as exc:
        raise _failed(coordinators, leader, exc) from exc


@click.group(cls=PointingGroup)
@click.option("--coordinator", envvar=COORDINATOR_ENV, metavar="HOST:PORT[,HOST:PORT]",
              help=f"Coordinator address(es); default ${COORDINATOR_ENV}.")
@click.option("--cacert", envvar=TLS_ENV["cacert"], metavar="FILE",
              help=f"The cluster's CA certificate (ca.crt): call over TLS; default ${TLS_ENV['cacert']}.")
@click.option("--cert", envvar=TLS_ENV["cert"], metavar="FILE",
              help=f"Your operator certificate (`trainerd certs operator`); default ${TLS_ENV['cert']}.")
@click.option("--key", envvar=TLS_ENV["key"], metavar="FILE", help=f"Its key; default ${TLS_ENV['key']}.")
@click.pass_context
def cli(ctx: click.Context, coordinator: str | None, cacert: str | None, cert: str | None, key: str | None) -> None:
    """See and steer a trainerd cluster."""
    ctx.obj = GlobalOptions(coordinator, cacert, cert, key)


@cli.command()
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.pass_obj
def status(options: GlobalOptions, output: str) -> None:
    """The coordinator, the nodes and the job."""
    _, reply = fetch_status(_coordinators(options))
    data = status_to_json(reply)
    if output == "json":
        click.echo(json.dumps(data, indent=2, allow_nan=False))
        return
    print_status(data)


@cli.command()
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events as they happen.")
@click.pass_obj
def events(options: GlobalOptions, output: str, follow: bool) -> None:
    """What happened to the nodes and the job, oldest first."""
    coordinators = _coordinators(options)
    after = 0
    while True:
        reply = call_control(coordinators, "ListEvents", pb.EventsRequest(after_seq=after, limit=EVENTS_PAGE))
        for event in reply.events:
            after = max(after, event.seq)
            if output == "json":
                click.echo(json.dumps(event_to_json(event)))
            else:
                stamp = datetime.datetime.fromtimestamp(event.at).strftime("%Y-%m-%d %H:%M:%S")
                # Escaped again here: events written before peer text was escaped at the servicer hold it raw.
                click.echo(f"{stamp}  {escaped(event.kind):<20} {escaped(event.message)}")
        if len(reply.events) == EVENTS_PAGE:
            continue  # a full page: there may be more at once
        if not follow:
            return
        time.sleep(FOLLOW_POLL_S)


def _rank_argument(ctx: click.Context, param: click.Parameter, value: str) -> int:
    if value == "scheduler":
        return -1
    try:
        rank = int(value)
    except ValueError:
        rank = -2
    if rank < 0:
        raise click.BadParameter(f"{value!r} is not a rank (0, 1, ...) or 'scheduler'")
    return rank


@cli.command()
@click.argument("rank", metavar="RANK", callback=_rank_argument)
@click.option("-f", "--follow", is_flag=True, help="Keep printing what the process writes until it exits.")
@click.option("--generation", type=click.IntRange(min=1), help="An earlier generation (default: the current one).")
@click.option("--tail", type=click.IntRange(min=0), help="Only the last N lines.")
@click.pass_obj
def logs(options: GlobalOptions, rank: int, follow: bool, generation: int | None, tail: int | None) -> None:
    """The output of RANK (or 'scheduler'), read from its host by its agent: no SSH needed."""
    coordinators = _coordinators(options)
    out = sys.stdout.buffer  # what click.get_binary_stream("stdout") returned; click 8.5 deprecates it

    def read(generation: int, offset: int) -> pb.LogReply:
        return call_control(coordinators, "ReadLog", pb.LogRequest(rank=rank, generation=generation, offset=offset,
                                                                   max_bytes=LOG_CHUNK_BYTES), LOG_RPC_TIMEOUT_S)

    offset = 0 if tail is None else -min(LOG_CHUNK_BYTES, max(TAIL_MIN_BYTES, tail * TAIL_BYTES_PER_LINE))
    reply = read(generation or 0, offset)
    pinned = reply.generation  # a follow stays with this generation even when a new one starts
    data = reply.data
    if tail is not None:
        lines = data.splitlines(keepends=True)
        if reply.offset > 0 and lines:
            lines = lines[1:]  # the first line was cut by the byte offset
        data = b"".join(lines[-tail:] if tail else [])
    out.write(data)
    position = reply.offset + len(reply.data)
    while True:
        while position < reply.size:
            reply = read(pinned, position)
            if not reply.data:
                break
            out.write(reply.data)
            position = reply.offset + len(reply.data)
        out.flush()
        if not follow or not reply.running:
            return
        time.sleep(FOLLOW_POLL_S)
        reply = read(pinned, position)
        out.write(reply.data)
        position = reply.offset + len(reply.data)


@cli.command()
@click.option("--now", is_flag=True, help="Stop the processes at once, without the checkpoint (or graceful exit) "
              "first: the resume goes back to the newest checkpoint.")
@click.pass_obj
def pause(options: GlobalOptions, now: bool) -> None:
    """Stop the job's processes and keep it PAUSED until `resume`. A running job saves a checkpoint
    first (a script with a graceful exit file leaves at a step boundary), so the resume loses nothing."""
    reply = call_control(_coordinators(options), "Pause", pb.PauseRequest(now=now))
    click.echo(reply.message)


@cli.command()
@click.option("--from-step", type=click.IntRange(min=1), help="Restart from the checkpoint of this step "
              "(default: the newest good one; `trainerctl checkpoint list` shows them).")
@click.pass_obj
def resume(options: GlobalOptions, from_step: int | None) -> None:
    """Continue a PAUSED or FAILED job (a FAILED job gets its restart budget back)."""
    request = pb.ResumeRequest() if from_step is None else pb.ResumeRequest(from_step=from_step)
    click.echo(call_control(_coordinators(options), "Resume", request).message)


@cli.group()
def nodes() -> None:
    """Take nodes out of service and back."""


@nodes.command()
@click.argument("name")
@click.pass_obj
def drain(options: GlobalOptions, name: str) -> None:
    """Stop using NAME: a running job lets it go at its next checkpoint."""
    click.echo(call_control(_coordinators(options), "SetDrain", pb.DrainRequest(node=name, drained=True)).message)


@nodes.command()
@click.argument("name")
@click.pass_obj
def undrain(options: GlobalOptions, name: str) -> None:
    """Use NAME again (also lifts a quarantine); a running job takes it in at a checkpoint."""
    click.echo(call_control(_coordinators(options), "SetDrain", pb.DrainRequest(node=name, drained=False)).message)


@nodes.command()
@click.argument("name")
@click.pass_obj
def revoke(options: GlobalOptions, name: str) -> None:
    """Revoke NAME's certificates: its session closes, and the coordinators and the other agents refuse them
    from now on. The host joins again only with a new token."""
    click.echo(call_control(_coordinators(options), "RevokeNode", pb.RevokeNodeRequest(node=name)).message)


def _duration(ctx: click.Context, param: click.Parameter, value: str) -> float:
    """Seconds in `value`: a number with s, m, h or d (90m, 1h, 2d)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        seconds = float(value[:-1]) * units[value[-1]]
    except (KeyError, ValueError, IndexError):
        raise click.BadParameter(f"{value!r} is not a duration: a number and s, m, h or d (90m, 1h)") from None
    if seconds <= 0:
        raise click.BadParameter(f"{value!r} is not a duration of more than 0 s")
    return seconds


@cli.group()
def tokens() -> None:
    """Join tokens: a new host joins with one instead of files copied from the head host."""


@tokens.command("create")
@click.option("--ttl", default="1h", show_default=True, callback=_duration, help="How long it can be used.")
@click.option("--uses", type=click.IntRange(min=1), help="How many hosts may join with it (default: any).")
@click.pass_obj
def tokens_create(options: GlobalOptions, ttl: float, uses: int | None) -> None:
    """Make a join token and print the command that joins a host with it. The token is a secret: whoever
    holds it can take a node certificate until it expires or is spent."""
    reply = call_control(_coordinators(options), "CreateToken", pb.CreateTokenRequest(ttl_s=ttl, uses=uses or 0))
    expires = datetime.datetime.fromtimestamp(reply.expires_at).strftime("%Y-%m-%d %H:%M:%S")
    click.echo(f"join token {reply.token.split('.')[0]}, valid until {expires}, "
               f"{uses or 'any number of'} use(s); on the new host run:")
    click.echo(f"trainerd-agent --join {reply.token} --join-address {reply.join_address} "
               f"--coordinator {','.join(reply.coordinators)} --ca-hash {reply.ca_pin} --node-name NAME")


@tokens.command("list")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.pass_obj
def tokens_list(options: GlobalOptions, output: str) -> None:
    """The live join tokens (their ids: the secrets are not kept)."""
    reply = call_control(_coordinators(options), "ListTokens", pb.ListTokensRequest())
    entries = [{"id": t.id, "created_at": t.created_at, "expires_at": t.expires_at,
                "uses_left": None if t.uses_left < 0 else t.uses_left} for t in reply.tokens]
    if output == "json":
        click.echo(json.dumps(entries, indent=2))
        return
    table = Table(title=f"join tokens ({len(entries)})")
    for column in ("id", "expires", "uses left"):
        table.add_column(column)
    for entry in entries:
        expires = datetime.datetime.fromtimestamp(entry["expires_at"]).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(entry["id"], expires, "any" if entry["uses_left"] is None else str(entry["uses_left"]))
    Console().print(table)


@tokens.command("delete")
@click.argument("token_id", metavar="ID")
@click.pass_obj
def tokens_delete(options: GlobalOptions, token_id: str) -> None:
    """Delete join token ID (the part before the dot): no host joins with it from now on."""
    click.echo(call_control(_coordinators(options), "DeleteToken", pb.DeleteTokenRequest(id=token_id)).message)


def _sample_range(ctx, param, value: str) -> tuple[int, int]:
    start, sep, end = value.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(start), int(end)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not START:END (sample positions, END exclusive)") from None


@cli.group(invoke_without_command=True)
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.pass_context
def skips(ctx: click.Context, output: str) -> None:
    """The skip ledger: sample ranges every later generation leaves out."""
    if ctx.invoked_subcommand is not None:
        return
    reply = call_control(_coordinators(ctx.obj), "ListSkips", pb.SkipsRequest())
    entries = [{"start": e.start, "end": e.end, "reason": e.reason, "step": e.step, "generation": e.generation}
               for e in reply.skips]
    if output == "json":
        click.echo(json.dumps(entries, indent=2))
        return
    table = Table(title=f"skip ledger ({len(entries)} range(s))")
    for column in ("start", "end", "step", "generation", "reason"):
        table.add_column(column)
    for e in entries:
        table.add_row(str(e["start"]), str(e["end"]), str(e["step"]), str(e["generation"]), e["reason"])
    Console().print(table)


@skips.command("add")
@click.argument("sample_range", metavar="START:END", callback=_sample_range)
@click.option("--reason", required=True, help="Why these samples are left out (kept in the ledger).")
@click.pass_obj
def skips_add(options: GlobalOptions, sample_range: tuple[int, int], reason: str) -> None:
    """Leave samples START..END-1 out from the next generation on."""
    start, end = sample_range
    request = pb.AddSkipRequest(start=start, end=end, reason=reason)
    click.echo(call_control(_coordinators(options), "AddSkip", request).message)


def _name_column(table: Table, title: str, names: list[str]) -> None:
    """A column of node names that a narrow terminal never cuts: rich would shorten both
    'trainerd-local-0' and 'trainerd-local-1' to 'trainerd-loc…' and the rows could not be told apart."""
    table.add_column(title, no_wrap=True, min_width=max(map(len, names), default=0))


def print_status(data: dict) -> None:
    # Lines are never wrapped: an operator greps them and a failure's message must stay whole.
    console = Console(soft_wrap=True)
    c = data["coordinator"]
    role = "leader" if c["is_leader"] else "standby"
    console.print(f"coordinator {c['answered_by']} ({role}); leader {c['leader'] or 'none'}")
    nodes = Table(title="nodes")
    _name_column(nodes, "name", [node["name"] for node in data["nodes"]])
    for column in ("state", "host", "devices", "last heartbeat", "service"):
        nodes.add_column(column)
    for node in data["nodes"]:
        age = node["last_heartbeat_age_s"]
        service = "drained" if node["drained"] else "quarantined" if node["quarantined"] else "in service"
        if node["crashes"]:
            service += f" ({node['crashes']} crash{'es' if node['crashes'] > 1 else ''})"
        nodes.add_row(node["name"], node["state"], node["host"], str(len(node["devices"])),
                      "-" if age is None else f"{age:.1f}s ago", service)
    console.print(nodes)
    job = data["job"]
    if job is None:
        console.print("job: none")
        return
    console.print(
        f"job {job['name']}: {job['state']}  generation {job['generation']}  "
        f"world size {job['world_size']}  epoch {_or_dash(job['epoch'])}  step {_or_dash(job['step'])}  "
        f"loss {_or_dash(job['loss'], '.4f')}  grad norm {_or_dash(job['grad_norm'], '.3g')}  "
        f"samples/s {_or_dash(job['samples_per_s'] or None, '.0f')}  "
        f"checkpoint {_or_dash(job['last_checkpoint_step'])}  "
        f"skipped ranges {job['skipped_batches']}"
    )
    console.print(f"restarts {job['restarts']} ({job['crash_restarts']} of {job['restart_budget']} crash "
                  f"restarts spent)")
    if job["waiting_for"]:
        console.print(f"waiting for nodes: {job['waiting_for']}")
    if job["spares"]:
        console.print(f"spares: {', '.join(job['spares'])}", markup=False)
    for warning in job["warnings"]:
        console.print(f"warning: {escaped(warning)}", markup=False)
    if job["pausing"]:
        console.print("pausing: a checkpoint (or the script's graceful exit) first, then PAUSED "
                      "(`trainerctl pause --now` stops it at once, `trainerctl resume` calls the pause off)")
    if job["state"] in ("RUNNING", "PENDING", "RECOVERING") and not job["hang_detection"]:
        console.print("hang detection: off until a rank reports progress (LossMonitor/TimeMonitor lines, "
                      "job.progress_pattern, or the trainer runtime)")
    if job["ranks"]:
        ranks = Table(title="ranks")
        ranks.add_column("rank")
        _name_column(ranks, "node", [rank["node"] for rank in job["ranks"]])
        # Each rank's measure of the job's rate (the global batch over its step time), not its own share.
        for column in ("epoch", "step", "loss", "grad norm", "job samples/s"):
            ranks.add_column(column)
        for rank in job["ranks"]:
            rate = None if rank["from_output"] and not rank["samples_per_s"] else rank["samples_per_s"]
            ranks.add_row(str(rank["rank"]), rank["node"], _or_dash(rank["epoch"]), str(rank["step"]),
                          _or_dash(rank["loss"], ".4f"), _or_dash(rank["grad_norm"], ".3g"), _or_dash(rate, ".0f"))
        console.print(ranks)
    failure = job["last_failure"]
    if failure is not None:
        where = f" at {failure['location']}" if failure["location"] else ""
        console.print(f"last failure ({failure['cause']}{where}): {failure['message']}")
    recovery = job["last_recovery"]
    if recovery is not None:
        phases = "  ".join(f"{phase} {recovery[phase + '_s']:.2f}s" for phase in RECOVERY_PHASES
                           if recovery[phase + "_s"] is not None)
        source = f" ({recovery['resumed_from']})" if recovery["resumed_from"] else ""
        lost_steps = recovery["lost_steps"]
        lost = "" if lost_steps is None else f", {lost_steps} step{'' if lost_steps == 1 else 's'} lost"
        if recovery["resumed_from_step"] is None and recovery["relaunch_s"] is not None:
            start = "from the script's own checkpoint, if it keeps one"  # launched: where it resumes is not known
        else:
            start = f"from step {_or_dash(recovery['resumed_from_step'])}"
        console.print(f"last recovery ({recovery['cause']}, {start}{source}{lost}): {phases or 'in progress'}")
        cost = recovery["cost_s"]
        console.print(f"  cost {sum(cost.values()):.2f}s: "
                      + "  ".join(f"{part.replace('_', ' ')} {cost[part]:.2f}s" for part in COST_PARTS))
    goodput = job["goodput"]
    if goodput is not None:
        spent = "  ".join(f"{phase.replace('_', ' ')} {goodput['phases'][phase + '_s']:.1f}s"
                          for phase in GOODPUT_PHASES if goodput["phases"][phase + "_s"] >= 0.05)
        console.print(f"goodput {goodput['ratio']:.1%} of {goodput['wall_s']:.1f}s: {spent or 'nothing yet'}")


def _or_dash(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _register_subcommands() -> None:
    from daemon.cli.checkpoint_commands import checkpoint

    cli.add_command(checkpoint)


GLOBAL_OPTIONS = ("--coordinator", "--cacert", "--cert", "--key")


def global_options_first(argv: list[str]) -> list[str]:
    """`argv` with the connection options moved before the command wherever they were written: `trainerctl
    status --coordinator HOST:PORT` works, as kubectl's and etcdctl's flags do. Nothing after `--` moves."""
    moved: list[str] = []
    rest: list[str] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            rest.extend(argv[index:])
            break
        if rest and word.split("=", 1)[0] in GLOBAL_OPTIONS:
            taken = 1 if "=" in word else 2
            moved.extend(argv[index:index + taken])
            index += taken
            continue
        rest.append(word)
        index += 1
    return moved + rest


def main() -> None:
    _register_subcommands()
    cli(args=global_options_first(sys.argv[1:]), prog_name="trainerctl")


if __name__ == "__main__":
    main()
