"""The resume token lets whoever holds it take over this node's session: its file is the owner's alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agent.session import IdentityFile


def test_the_identity_file_is_owner_only_whatever_the_umask_and_whatever_was_left_behind(tmp_path: Path) -> None:
    path = tmp_path / "identity.json"
    path.write_text("{}")
    path.chmod(0o644)  # written by an earlier agent version
    leftover = tmp_path / "identity.tmp"
    leftover.write_text("")
    leftover.chmod(0o666)  # a save interrupted before its rename
    old_umask = os.umask(0)
    try:
        IdentityFile(path).save_token("n1", "secret")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert IdentityFile(path).load_token("n1") == "secret"
    assert leftover.read_text() == ""  # a save writes a new temporary file of its own, never into a leftover
