"""Peer text is escaped before it is logged, stored or printed (common/peer_text.py)."""

from __future__ import annotations

from common.peer_text import escaped


def test_control_characters_are_written_as_escapes_and_the_rest_is_kept() -> None:
    assert escaped("10.0.0.1") == "10.0.0.1"
    assert escaped("h\nWARNING forged line") == "h\\nWARNING forged line"
    assert escaped("\x1b]0;owned\x07title") == "\\x1b]0;owned\\x07title"
    assert escaped("a\u2028b\x9bc\x7f") == "a\\u2028b\\x9bc\\x7f"
    assert escaped("ünïcode ok 名前") == "ünïcode ok 名前"
    assert escaped("line 1\nline 2\x1b[31m", keep="\n") == "line 1\nline 2\\x1b[31m"
