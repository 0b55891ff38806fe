"""The worker-side trainer runtime: rank context, communication set-up, progress reporting, and
checkpoints (resume, periodic and requested saves, commit reports).

Nothing here imports MindSpore at package import time; only `communication` and `checkpointing` (and
the script that calls them) do, inside their functions. The agent and the coordinator import nothing
from here: what they share with workers (progress datagrams, exit codes, the control and skips files)
is in `proto/`.
"""
