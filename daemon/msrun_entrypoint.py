"""An entrypoint that runs msrun: what a user who ran `msrun ... train.py` before pastes into `job.entrypoint`.

msrun starts a scheduler and its workers itself; under trainerd every process the agents start would start
a cluster of its own. trainerd does msrun's part (each process gets msrun's environment), so the entrypoint
is the command msrun runs. `script_msrun_runs` finds it, for the one-line refusal that says what to write.
"""

from __future__ import annotations

import os

from proto.vocabulary import PYTHON_WORD

# msrun's module (the `msrun` console script runs its main).
MSRUN_MODULE = "mindspore.parallel.cluster.run"


def _msrun_arguments(argv: list[str]) -> list[str] | None:
    """What follows msrun in `argv` (its options, the script and the script's arguments); None when
    `argv` does not run msrun: `msrun ...`, `{python} -m mindspore.parallel.cluster.run ...` or
    `{python} /path/to/msrun ...` (a script's own argument that happens to say msrun is no match)."""
    if argv and os.path.basename(argv[0]) == "msrun":
        return argv[1:]
    if argv[1:3] == ["-m", MSRUN_MODULE]:
        return argv[3:]
    if len(argv) > 1 and os.path.basename(argv[1]) == "msrun":
        return argv[2:]
    return None


def script_msrun_runs(argv: list[str]) -> list[str] | None:
    """The command msrun would run for `argv` (`{python}` and the script, with the script's arguments),
    or None when `argv` does not run msrun. Every msrun 2.10 option takes a value (`--opt=v` or
    `--opt v`); the first word that is not an option is the script and the rest are its own."""
    rest = _msrun_arguments(argv)
    if rest is None:
        return None
    i = 0
    while i < len(rest) and rest[i].startswith("-"):
        i += 1 if "=" in rest[i] else 2
    if i >= len(rest):
        return [PYTHON_WORD, "train.py"]  # msrun without a script: show the shape
    script = rest[i]
    return ([PYTHON_WORD, script] if script.endswith(".py") else [script]) + rest[i + 1:]
