"""What this agent agrees to run, checked before a Launch starts anything.

A Launch comes from whatever answers on the coordinator address. The agent file's
`allowed_entrypoints` names the argv prefixes it runs (by default only its own interpreter,
"{python}"), compared with the argv as it arrives, before "{python}" is expanded, beside trainerd's own
scheduler (`proto.vocabulary.SCHEDULER_ARGV`, exactly); and no process may
be given a variable that changes which code it runs (`proto.launch_env.forbidden_job_env`, the rule
the coordinator applies to the cluster file too).
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.commands import Launch, Standby
from proto.launch_env import forbidden_job_env
from proto.vocabulary import PYTHON_WORD, SCHEDULER_ARGV, names_a_python, starts_with_one_of


def entrypoint_refusal(argv: Sequence[str], allowed_entrypoints: Sequence[Sequence[str]],
                       verb: str = "run") -> str | None:
    """Why `argv` may not run (it starts with none of the allowed prefixes), or None when it may."""
    if starts_with_one_of(argv, allowed_entrypoints):
        return None
    allowed = [list(prefix) for prefix in allowed_entrypoints]
    hint = ""
    if argv and names_a_python(argv[0]) and any(p[:1] == [PYTHON_WORD] for p in allowed):
        hint = f" (write {PYTHON_WORD} for the agent's own interpreter; a python from PATH is never run)"
    return (f"refused to {verb} {list(argv)!r:.300}: it starts with none of allowed_entrypoints {allowed!r:.300} "
            f"in the agent file{hint}")


def launch_refusal(launch: Launch | Standby, allowed_entrypoints: Sequence[Sequence[str]]) -> str | None:
    """Why none of `launch`'s processes may start (or be prepared for, a Standby's), in one line, or None when
    they all may."""
    for spec in launch.processes:
        argv = list(spec.argv)
        refusal = None if tuple(argv) == SCHEDULER_ARGV else entrypoint_refusal(argv, allowed_entrypoints, "launch")
        if refusal is not None:
            return refusal
        for name in sorted(spec.env):
            reason = forbidden_job_env(name)
            if reason is not None:
                return f"refused to launch {argv!r:.300}: its environment sets {name!r:.80} ({reason})"
    return None
