"""Imported by trainerctl before grpc: gRPC's C core logs each failed TLS handshake to stderr (at INFO)
unless GRPC_VERBOSITY is set before it loads, and trainerctl's errors are the one line it prints itself.
An operator's own GRPC_VERBOSITY wins."""

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
