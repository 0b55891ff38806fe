"""The worker-side trainer runtime: rank context, communication set-up and progress reporting.

Nothing here imports MindSpore at package import time; only `communication` (and the script that
calls it) does, inside its functions, so the agent and the coordinator can use the pure parts.
"""
