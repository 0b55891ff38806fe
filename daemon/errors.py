"""The root of every error the coordinator raises, split by what the caller should do about it.

After kopf's temporary/permanent errors: a `RetryableError` may succeed if the same request is
tried again later or at another coordinator; a `PermanentError` will fail the same way until the
request or the cluster changes. Each error is defined next to the code that raises it and derives
from one of these; daemon/grpc_errors.py turns them into gRPC status codes in one table.
"""

from __future__ import annotations


class TrainerdError(Exception):
    """Base of every trainerd coordinator error; the message is one line an operator can act on."""


class RetryableError(TrainerdError):
    """Temporary: try the same request again after a delay, or at the coordinator that leads now."""


class PermanentError(TrainerdError):
    """Retrying the same request cannot help: change the request or the cluster first."""
