"""trainerd as `trainerd ARGS...` runs it, and at every SIGUSR2 a record of its server's connections
(bench/grpc_sockets.py) in DIRECTORY: `python bench/channelz_trainerd.py DIRECTORY ARGS...`. Used by
`bench/heartbeats.py --channelz`."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import grpc_core_settings  # noqa: E402

grpc_core_settings.apply()  # before anything imports grpc, as trainerd's entry module does

from bench.grpc_sockets import dump_on_signal  # noqa: E402
from daemon.cli.trainerd_main import main  # noqa: E402

if __name__ == "__main__":
    dump_on_signal(Path(sys.argv[1]), "server")
    sys.argv = ["trainerd", *sys.argv[2:]]
    main()
