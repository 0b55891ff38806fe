"""Text a peer sent (a host name, a node check's detail, a log tail, an exception line), made safe to log,
store and print.

A peer's text is data: a newline in it forged a log line, and an OSC escape sequence retitled the operator's
terminal when `trainerctl events` printed it (issue 47). Every character that is not printable (the C0 and
C1 controls, DEL, line and paragraph separators) is written as its Python escape (`\\n`, `\\x1b`,
`\\u2028`), so the text stays readable and nothing it holds acts on what shows it.
"""

from __future__ import annotations


def escaped(text: str, keep: str = "") -> str:
    """`text` with every character that is not printable, but those in `keep` (a log tail keeps its "\\n"),
    written as its Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)
