"""Reading stored chunks through `safe_open(...).get_slice(...)`, so only the bytes asked for are read.

Before the first slice of a key, the reader checks that the file stores that key with the dtype and shape
the layout says: a file that disagrees with its manifest is refused instead of read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from trainer.checkpoint.errors import CorruptCheckpoint
from trainer.checkpoint.layout import TensorLayout
from trainer.checkpoint.manifest import confined_path
from trainer.checkpoint.read_plan import ReadItem


class ChunkReader:
    """Reads slices of the chunks a layout names from the files of one directory, each file opened once."""

    def __init__(self, directory: Path, tensors: Mapping[str, TensorLayout]) -> None:
        self._directory = directory
        self._expected = {
            (chunk.file, chunk.key): (layout.dtype, list(chunk.region.sizes))
            for layout in tensors.values()
            for chunk in layout.chunks
        }
        self._open: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}
        self._slices: dict[tuple[str, str], Any] = {}

    def read(self, item: ReadItem) -> np.ndarray:
        try:
            return self._stored(item.file, item.key)[item.chunk_slices()]
        except SafetensorError as exc:
            raise CorruptCheckpoint(f"{self._directory.name}/{item.file}: cannot read key '{item.key}': {exc}") from exc

    def check_all(self) -> None:
        """Checks every chunk's key, dtype and shape in the file headers, reading no tensor data."""
        for file, key in self._expected:
            self._stored(file, key)

    def _stored(self, file: str, key: str) -> Any:
        stored = self._slices.get((file, key))
        if stored is None:
            where = f"{self._directory.name}/{file}"
            handle = self._file(file, where)
            if key not in self._keys[file]:
                raise CorruptCheckpoint(f"{where} has no key '{key}'")
            stored = handle.get_slice(key)
            expected = self._expected[(file, key)]
            if (stored.get_dtype(), stored.get_shape()) != expected:
                raise CorruptCheckpoint(
                    f"{where}: key '{key}' holds {stored.get_dtype()} {stored.get_shape()}, "
                    f"the manifest says {expected[0]} {expected[1]}"
                )
            self._slices[(file, key)] = stored
        return stored

    def _file(self, name: str, where: str) -> Any:
        handle = self._open.get(name)
        if handle is None:
            path = confined_path(self._directory, name, self._directory.name)
            try:
                handle = safe_open(path, framework="numpy").__enter__()
            except (SafetensorError, OSError) as exc:
                raise CorruptCheckpoint(f"{where} is not a readable safetensors file: {exc}") from exc
            self._open[name] = handle
            self._keys[name] = set(handle.keys())
        return handle

    def close(self) -> None:
        self._slices.clear()
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
