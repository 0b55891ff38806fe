"""The exit statuses of a training process that mean something to the agent and the coordinator.

Pure (no MindSpore): training processes exit with them, and the coordinator reads them to tell a usage
error (relaunching cannot help) and an unreadable checkpoint (fall back to an older one) from a crash.
Any other non-zero status is a crash; a negative one (a signal) is reported by the agent as such.
"""

EXIT_OK = 0
# A mistake in the flags or the launch environment, or a resume that contradicts them (another --seed):
# printed in one line on stderr; the same launch fails the same way again.
EXIT_USAGE = 2
# TRAINERD_RESUME_FROM names a checkpoint that cannot be loaded or does not verify (EX_DATAERR):
# printed in one line naming the path and the problem; an older checkpoint may still do.
EXIT_CHECKPOINT_UNREADABLE = 65
# The entrypoint could not be executed at all (reported by the agent, like a shell's "command not
# found"): relaunching the same argv cannot help.
EXIT_CANNOT_EXECUTE = 127
