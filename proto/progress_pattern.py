"""`job.progress_pattern`: a user's regex that finds progress in a rank's output.

The coordinator validates it when it loads the cluster file and sends it in every Launch; the agent
compiles it again and matches it against each line of every rank's output. Both use this one
function, so a pattern the coordinator accepted is one the agent can use.
"""

from __future__ import annotations

import re

MAX_PATTERN_CHARS = 1000
REQUIRED_GROUPS = frozenset({"step"})
OPTIONAL_GROUPS = frozenset({"epoch", "loss", "samples_per_s"})


def compile_progress_pattern(text: str) -> re.Pattern[str]:
    """The compiled pattern; raises ValueError with a one-line reason when it cannot be used."""
    if not text or len(text) > MAX_PATTERN_CHARS:
        raise ValueError(f"must have 1 to {MAX_PATTERN_CHARS} characters")
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression: {exc}") from None
    groups = set(pattern.groupindex)
    missing = sorted(REQUIRED_GROUPS - groups)
    if missing:
        raise ValueError(f"needs a named group {missing[0]!r}, as in (?P<step>\\d+)")
    unknown = sorted(groups - REQUIRED_GROUPS - OPTIONAL_GROUPS)
    if unknown:
        known = ", ".join(sorted(REQUIRED_GROUPS | OPTIONAL_GROUPS))
        raise ValueError(f"unknown named group {unknown[0]!r} (known: {known})")
    return pattern
