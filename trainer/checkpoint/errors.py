"""The errors the checkpoint package raises: every failure a caller should handle is one of these."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint could not be saved, found or loaded. The message is one line naming the file or tensor."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint on disk is incomplete, damaged or hostile: refused, nothing was loaded from it."""


class NoCheckpoint(CheckpointError):
    """No complete checkpoint that verifies exists under the root."""


class UnsupportedLayout(CheckpointError):
    """A parallel layout the layout model cannot represent exactly (uneven splits, pipeline stages, ...)."""
