"""`job.progress_pattern`: a user's regex that finds progress in a rank's output.

The coordinator validates it when it loads the cluster file and sends it in every Launch; the agent
compiles it again and matches it against each line of every rank's output. Both use this one
function, so a pattern the coordinator accepted is one the agent can use.
"""

from __future__ import annotations

import re

MAX_PATTERN_CHARS = 1000
# One of these must be present: `global_step` counts over the whole run, `step` may restart each epoch.
STEP_GROUPS = ("step", "global_step")
PATTERN_GROUPS = frozenset({"epoch", "step", "global_step", "loss", "samples_per_s", "step_time_ms"})


class ProgressPatternError(ValueError):
    """The pattern cannot be used; the message says why in one line."""


def compile_progress_pattern(text: str) -> re.Pattern[str]:
    """The compiled pattern.

    Raises:
        ProgressPatternError: it is empty or too long, does not compile, or its named groups are wrong.
    """
    if not text or len(text) > MAX_PATTERN_CHARS:
        raise ProgressPatternError(f"must have 1 to {MAX_PATTERN_CHARS} characters")
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise ProgressPatternError(f"not a valid regular expression: {exc}") from None
    unknown = sorted(set(pattern.groupindex) - PATTERN_GROUPS)
    if unknown:
        raise ProgressPatternError(f"unknown named group {unknown[0]!r} (allowed: {', '.join(sorted(PATTERN_GROUPS))})")
    if not any(group in pattern.groupindex for group in STEP_GROUPS):
        raise ProgressPatternError("needs a named group 'step' (or 'global_step'), as in (?P<step>\\d+)")
    return pattern
