"""The worker-side trainer runtime: rank context, communication set-up, progress reporting,
checkpoints (resume, periodic and requested saves, commit reports), the in-step guard, and for
`Model.train` scripts the callback with its guarded train cell and elastic dataset (`callback`).

Nothing here imports MindSpore at package import time; `communication` and `checkpointing` import it
inside their functions, `guard`, `guarded_cell`, `elastic_dataset` and `callback` when they are imported.
The agent and the coordinator import nothing from here: what they share with workers (progress
datagrams, exit codes, the control and skips files) is in `proto/`.
"""
