"""A trainer stand-in without MindSpore, for tests of what the agent and the coordinator make of the
reports: rank 0 reports steps 1-5 and commits step 5; once the file CONTROL/go exists it reports
steps 6-10, commits step 10, touches CONTROL/sent and reports nothing more. The scheduler and the
other ranks only wait to be stopped.

    {python} tests/integration/scripted_trainer.py CONTROL CHECKPOINT_DIR
"""

import sys
import time
from pathlib import Path

from trainer.runtime.progress import ProgressReporter
from trainer.runtime.rank_context import RankContext

SAMPLES_PER_STEP = 8


def train(reporter: ProgressReporter, first: int, last: int, checkpoint_dir: Path) -> None:
    for step in range(first, last + 1):
        reporter.step(step, loss=1.0 / step, grad_norm=1.0, samples_per_s=100.0,
                      consumed_samples=step * SAMPLES_PER_STEP)
        time.sleep(0.05)
    reporter.checkpoint(last, last * SAMPLES_PER_STEP, str(checkpoint_dir / f"step_{last:08d}"))


def main(control: Path, checkpoint_dir: Path) -> None:
    context = RankContext.from_environ()
    if context.rank == 0:
        with ProgressReporter.for_rank(context) as reporter:
            train(reporter, 1, 5, checkpoint_dir)
            while not (control / "go").exists():
                time.sleep(0.05)
            train(reporter, 6, 10, checkpoint_dir)
            (control / "sent").touch()
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
