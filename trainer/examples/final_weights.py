"""The examples' final weights: what the tests and benches compare across runs and ranks."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from mindspore import nn

from common.atomic_write import write_atomically


def save_weights(network: nn.Cell, path: Path) -> None:
    """Write every trainable parameter to an .npz file, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    archive = io.BytesIO()
    np.savez(archive, **{param.name: param.asnumpy() for param in network.trainable_params()})
    write_atomically(path, archive.getvalue())
