"""The MindSpore scheduler of a generation, run by the agent as `{python} -m trainer.runtime.scheduler`.

msrun runs the job's own command as the scheduler too, and relies on the script calling
`mindspore.communication.init()` first thing: in the scheduler that call serves the cluster and never
returns. A script that never calls it (one written for a single device) then trains a second copy in the
scheduler, beside its rank, writing the same checkpoint files in the same working directory. So for a job run
by the agent's own interpreter the scheduler is this module (daemon/job/launch_plan.py): it runs none of the
job's code, only MindSpore's scheduler, which is the same whatever the script (for the scheduler role
MindSpore always takes its own CPU collective backend, mccl).

Exit protocol, as the job's own scheduler: MindSpore ends the process once every worker has finished (status
0, non-zero when a worker was lost); SIGTERM ends it at once. When no worker joins within MS_TOPO_TIMEOUT,
MindSpore gives up: at world size 1 that is the script training on its own, without `init()`, and the
scheduler then waits for the generation to end instead of ending it; at any other world size the generation
cannot form, and the scheduler exits 1 with MindSpore's reason.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from proto.exit_codes import EXIT_USAGE
from trainer.runtime.rank_context import RankContext, RankContextError

MINDSPORE_TOPOLOGY_TIMEOUT_S = 1800.0  # MindSpore's own when MS_TOPO_TIMEOUT is unset (trainerd sets 600, as msrun)


def main() -> int:
    # A supervisor may have started the agent with SIGTERM ignored, and exec keeps that: the agent's Stop
    # must end the scheduler.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        ctx = RankContext.from_environ()
    except RankContextError as exc:
        print(f"trainerd scheduler: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if not ctx.is_scheduler:
        print("trainerd scheduler: MS_ROLE is not MS_SCHED: only the agent runs this, as a generation's scheduler",
              file=sys.stderr, flush=True)
        return EXIT_USAGE

    import mindspore as ms
    from mindspore.communication import init

    ms.set_device("CPU")  # the scheduler computes nothing: it takes no accelerator
    print(f"trainerd scheduler: job {ctx.job} generation {ctx.generation}: serving the cluster of "
          f"{ctx.world_size} rank(s) at {ctx.scheduler_address}", flush=True)
    started = time.monotonic()
    try:
        init()
    except RuntimeError as exc:
        waited = time.monotonic() - started
        if ctx.world_size != 1 or waited < _topology_timeout_s():
            print(f"trainerd scheduler: MindSpore's scheduler failed after {waited:.1f} s: "
                  f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr, flush=True)
            return 1
        print(f"trainerd scheduler: no rank joined the cluster in {waited:.0f} s: the job's one rank trains "
              "without mindspore.communication.init() and needs no scheduler; waiting for the generation to end",
              flush=True)
        while True:
            signal.pause()
    return 0  # not reached with MindSpore 2.10: its scheduler ends the process


def _topology_timeout_s() -> float:
    try:
        return float(os.environ.get("MS_TOPO_TIMEOUT", MINDSPORE_TOPOLOGY_TIMEOUT_S))
    except ValueError:
        return MINDSPORE_TOPOLOGY_TIMEOUT_S


if __name__ == "__main__":
    sys.exit(main())
