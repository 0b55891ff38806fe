"""The examples' final weights: what the tests and benches compare across runs and ranks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from mindspore import nn


def save_weights(network: nn.Cell, path: Path) -> None:
    """Write every trainable parameter to an .npz file, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        np.savez(f, **{param.name: param.asnumpy() for param in network.trainable_params()})
    os.replace(partial, path)
