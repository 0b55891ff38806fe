"""Run the warm worker's preload with every os.environ lookup recorded, then append the names to
$GETENV_RECORD (the C shim beside this file records the getenv() calls in the same file)."""

import os
import sys

looked_up: set[str] = set()


class RecordingEnviron(type(os.environ)):  # type: ignore[misc]
    def _record(self, key):
        looked_up.add(key.decode() if isinstance(key, bytes) else str(key))

    def __getitem__(self, key):
        self._record(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._record(key)
        return super().__contains__(key)

    def get(self, key, default=None):
        self._record(key)
        return super().get(key, default)


os.environ.__class__ = RecordingEnviron

from agent.warm_worker import PRELOAD, preload  # noqa: E402

failed = preload(PRELOAD)
if failed:
    sys.exit(f"the preload failed:\n{failed}")
with open(os.environ["GETENV_RECORD"], "a") as out:
    out.write("".join(f"{name}\n" for name in sorted(looked_up)))
