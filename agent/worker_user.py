"""The user the training processes run as (`run_as` in the agent file).

The agent runs as root: it signals process groups, dumps stacks with py-spy and kills what a crashed
agent left behind. The training processes need none of that, and they run code the coordinator
names, so with `run_as` each runs as an ordinary user: that user's uid, group and supplementary
groups only (the Ascend device nodes' group, HwHiAiUser, among them when the user is in it; none of
the agent's) and its HOME, USER and LOGNAME. Such a process writes its log (owned by it), reports to
the progress socket (writable by its group) and works in the job's directory (agent/workdir_files.py).
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass
from typing import Any

from agent.config import RunAsSettings


@dataclass(frozen=True)
class WorkerUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups, from the group database
    home: str

    @classmethod
    def from_settings(cls, settings: RunAsSettings) -> WorkerUser:
        """The user and groups `settings` name (the config's validation made sure they exist).

        Raises:
            KeyError: the user or group is not (or no longer) known to this host.
        """
        entry = pwd.getpwnam(settings.user)
        gid = entry.pw_gid if settings.group is None else grp.getgrnam(settings.group).gr_gid
        return cls(entry.pw_name, entry.pw_uid, gid, tuple(os.getgrouplist(entry.pw_name, gid)), entry.pw_dir)

    def process_options(self) -> dict[str, Any]:
        """Keyword arguments of `subprocess.Popen` (and asyncio's `create_subprocess_exec`) that start
        a process as this user, with its own groups only."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def environment(self) -> dict[str, str]:
        """What a login would set: a process as this user must not take the agent's HOME for its own."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}
