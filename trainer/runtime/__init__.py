"""The worker-side trainer runtime: rank context, communication set-up, progress reporting, and
checkpoints (resume, periodic and requested saves, commit reports).

Nothing here imports MindSpore at package import time; only `communication` and `checkpointing` (and
the script that calls them) do, inside their functions, so the agent and the coordinator can use the
pure parts (`rank_context`, `progress`, `checkpoint_schedule`, `exit_codes`).
"""
