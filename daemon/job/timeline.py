"""How long each phase of a recovery took, and what it cost (docs/concepts/recovery.md), measured by the leader.

stop: the stop decided -> every node idle (or left out after the grace); relaunch: -> the Launch
sent (includes the crash backoff and any WAITING); first_step: -> every rank reported a step.
Beside the phases: what the relaunch resumed from, and how many steps that threw away.

The cost (`RecoveryTimeline.cost`) puts each second the recovery took from the job in one part:

- detect: the fault -> its detection (what the goodput accounting moved to detection for it);
- stop: the stop decided -> every process gone;
- relaunch: -> the Launch sent, plus whatever of the processes' start their ranks did not time themselves
  (the Launch on its way, the interpreter and imports or a warm worker's hand-over, the first step reports
  on their way back);
- comm_setup, load, compile: the own times (proto/progress_datagram.py StartupTimes) of the rank that started
  last: joining the cluster, loading what it resumed from, and its first step (a graph compile, or a compile
  cache load, and one step). The ranks end their first step together (it ends in a collective), so the one
  that spent least in these three started last, and the job waited for it: the others' longer `init()` was
  spent waiting for it to start. A rank that does not time its start (a script trainerd reads its steps
  from) leaves these 0 and its start in relaunch;
- lost_work: the seconds the job trained steps again, up to the furthest it had reached (goodput's
  lost_work since the launch), growing until the relaunched generation passes that step.

detect + stop + relaunch + comm_setup + load + compile is the fault -> every rank's first step; with
lost_work, the goodput the fault cost, less the checkpoint stalls the job has either way. Kept in memory:
a recovery that spans a leader change is timed from the takeover.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.progress_datagram import StartupTimes

COST_PARTS = ("detect", "stop", "relaunch", "comm_setup", "compile", "load", "lost_work")


@dataclass
class RecoveryTimeline:
    cause: str
    detected_at: float
    detect_s: float = 0.0  # the seconds the goodput accounting moved to detection for the fault
    stopped_at: float | None = None
    launched_at: float | None = None
    running_at: float | None = None
    resumed_from_step: int | None = None
    resumed_from: str = ""  # "memory" or "disk" (daemon.job.state.ResumeSource); "": from scratch
    lost_steps: int | None = None  # the failed generation's furthest step minus resumed_from_step
    lost_work_at_launch_s: float | None = None  # the job's goodput lost_work total when it relaunched
    # The relaunched ranks' own start-up times, as known when the job ran again (every rank reported a step).
    startups: dict[int, StartupTimes] = field(default_factory=dict)

    def phases(self) -> dict[str, float]:
        """Seconds per finished phase."""
        out: dict[str, float] = {}
        if self.stopped_at is not None:
            out["stop"] = self.stopped_at - self.detected_at
            if self.launched_at is not None:
                out["relaunch"] = self.launched_at - self.stopped_at
        if self.launched_at is not None and self.running_at is not None:
            out["first_step"] = self.running_at - self.launched_at
            out["total"] = self.running_at - self.detected_at
        return {name: round(seconds, 3) for name, seconds in out.items()}

    def cost(self, lost_work_total_s: float) -> dict[str, float]:
        """Seconds per part of COST_PARTS, as far as the recovery got (a part not reached yet is 0);
        `lost_work_total_s`: the job's goodput lost_work total now."""
        cost = dict.fromkeys(COST_PARTS, 0.0)
        cost["detect"] = self.detect_s
        if self.stopped_at is not None:
            cost["stop"] = self.stopped_at - self.detected_at
            if self.launched_at is not None:
                cost["relaunch"] = self.launched_at - self.stopped_at
        if self.launched_at is not None and self.running_at is not None:
            start = self.running_at - self.launched_at
            last = min(self.startups.values(), default=None, key=lambda s: s.comm_setup_s + s.load_s + s.first_step_s)
            if last is not None:
                timed = last.comm_setup_s + last.load_s + last.first_step_s
                # A rank's times fit inside the leader's launch -> first step; more (reports that raced a
                # clock's step) is scaled to fit, so that the parts still sum to the recovery's seconds.
                scale = min(1.0, start / timed) if timed > 0 else 0.0
                cost["comm_setup"] = last.comm_setup_s * scale
                cost["load"] = last.load_s * scale
                cost["compile"] = last.first_step_s * scale
                start -= timed * scale
            cost["relaunch"] += max(0.0, start)
        if self.lost_work_at_launch_s is not None:
            cost["lost_work"] = max(0.0, lost_work_total_s - self.lost_work_at_launch_s)
        return {part: round(max(0.0, seconds), 3) for part, seconds in cost.items()}
