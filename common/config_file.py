"""Loading YAML config files into strict pydantic models, shared by trainerd and trainerd-agent.

Every error becomes one `ConfigError` line naming the file and the key path, e.g.
`cluster.yaml: cluster.heartbeat.timeout_s: Input should be greater than 0`.
"""

from __future__ import annotations

import difflib
import ipaddress
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args

import pydantic
import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict


class ConfigError(Exception):
    """A config file or flag is wrong; the message is one line that says where and what."""


class StrictModel(BaseModel):
    """Unknown keys and silent type coercion are both errors in our config files."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def parse_host_port(text: str) -> tuple[str, int]:
    """Split `host:port` (IPv6 as `[::1]:port`); raise ValueError with a readable reason."""
    if not isinstance(text, str) or ":" not in text:
        raise ValueError(f"{text!r} is not HOST:PORT")
    scheme, separator, rest = text.partition("://")
    if separator:
        raise ValueError(f"{text!r} is a URL, not HOST:PORT: write {rest.rstrip('/')!r} (TLS comes from the "
                         f"certificate options, not a scheme)" if scheme.isalpha() else f"{text!r} is not HOST:PORT")
    host, _, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"{text!r} has no valid host")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text!r} has no valid port (1-65535)")
    return host, int(port_text)


def is_loopback(address: str) -> bool:
    """Whether `host:port` can be reached only from this host: localhost or a loopback IP (127.0.0.0/8,
    ::1). A wildcard (0.0.0.0, ::) or any other name is not."""
    host, _ = parse_host_port(address)
    return is_loopback_host(host)


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or an address, no port) is localhost or a loopback IP."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_address(text: str) -> str:
    parse_host_port(text)
    return text


Address = Annotated[str, AfterValidator(_check_address)]
"""A `host:port` string, validated."""

M = TypeVar("M", bound=BaseModel)


def describe_validation_error(source: str, exc: pydantic.ValidationError, prefix: str = "",
                              model: type[BaseModel] | None = None) -> str:
    errors = exc.errors()
    # A misspelt key is told first: the "Field required" of the key it was meant to be follows from it.
    first = next((error for error in errors if error["type"] == "extra_forbidden"), errors[0])
    where = ".".join(str(part) for part in first["loc"])
    if prefix:
        where = f"{prefix}.{where}" if where else prefix
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key"
        known = _keys_at(model, first["loc"][:-1]) if model is not None else []
        close = difflib.get_close_matches(str(first["loc"][-1]), known, n=1)
        if close:
            message += f" (did you mean {close[0]}?)"
    more = len(errors) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{source}: {where}: {message}{suffix}" if where else f"{source}: {message}{suffix}"


def _keys_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The keys the model takes at `loc` (a pydantic error location), [] where that is not a model."""
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = None if field is None else field.annotation
        models = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) != 1:  # not a model, or a union of several (`X | None` counts as X)
            return []
        model = models[0]
    return list(model.model_fields)


def load_yaml_mapping(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, not {type(data).__name__}")
    return data


def validate(model: type[M], data: Any, source: str, prefix: str = "") -> M:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(describe_validation_error(source, exc, prefix, model)) from exc
