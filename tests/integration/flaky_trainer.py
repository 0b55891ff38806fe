"""An entrypoint for crash-loop tests: while the file named by its first argument exists, it runs the
example job and exits 1 right after reporting its second step (a crash mid-training, which spends
the restart budget: a failure before any progress is the job's own error); else it runs the example
job with the remaining arguments.

    {python} tests/integration/flaky_trainer.py /tmp/broken --steps 20 ...
"""

import os
import sys

CRASH_AFTER_STEP = 2

if __name__ == "__main__":
    marker, *rest = sys.argv[1:]
    if os.path.exists(marker):
        from trainer.runtime.progress import ProgressReporter

        report_step = ProgressReporter.step

        def step_then_crash(self, step, *args, **kwargs):
            report_step(self, step, *args, **kwargs)
            if step >= CRASH_AFTER_STEP:
                print(f"flaky_trainer: {marker} exists: crashing after step {step}", file=sys.stderr, flush=True)
                os._exit(1)

        ProgressReporter.step = step_then_crash
    from trainer.examples.mlp import main

    sys.exit(main(rest))
