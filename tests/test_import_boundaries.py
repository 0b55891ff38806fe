"""The coordinator, the agent and trainerctl run on hosts without MindSpore: they must never import it."""

import subprocess
import sys

PROBE = """
import sys
import daemon.app, daemon.cli.trainerd_main, daemon.cli.trainerctl, agent.main
daemon.cli.trainerctl._register_subcommands()
loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'mindspore')
print(','.join(loaded))
"""


def test_coordinator_agent_and_cli_do_not_import_mindspore() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"MindSpore modules loaded: {result.stdout.strip()}"
