"""How long each phase of a recovery took (docs/concepts/recovery.md), measured by the leader.

stop: the stop decided -> every node idle (or left out after the grace); relaunch: -> the Launch
sent (includes the crash backoff and any WAITING); first_step: -> every rank reported a step.
Beside the phases: what the relaunch resumed from, and how many steps that threw away.
Kept in memory: a recovery that spans a leader change is timed from the takeover.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RecoveryTimeline:
    cause: str
    detected_at: float
    stopped_at: float | None = None
    launched_at: float | None = None
    running_at: float | None = None
    resumed_from_step: int | None = None
    resumed_from: str = ""  # "memory" or "disk" (daemon.job.state.ResumeSource); "": from scratch
    lost_steps: int | None = None  # the failed generation's furthest step minus resumed_from_step

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
