"""What starting a job's processes costs: forked from warm templates against started cold, in one run.

An agent starts every process of every generation. Started cold, each one is a new interpreter that
imports MindSpore (about 2 CPU-seconds); forked from a warm template (agent/warm_launcher.py), a node
imports it once per device and forks every later process. This bench starts GENERATIONS generations of
PROCESSES processes each (one per "device": DEVICE_ID 0..PROCESSES-1, as an agent's workers), each
`{python} -m trainer.examples.mlp --steps STEPS` on one rank, through the agent's own launchers:

- cold: `WarmLauncher(enabled=False)`, every process a new interpreter (the baseline);
- forked: `WarmLauncher()`, new for the run: the first generation waits for its templates' imports
  (started side by side by `prepare`, as the supervisor does), the later ones fork.

For each it prints every generation's wall time (from the first start to the last exit) and the CPU
time the whole machine spent in the run (from /proc/stat, user + system: a forked child's time is its
template's, not this process's child's, so getrusage cannot see it). Run it on an otherwise idle
machine; the variants alternate, `--rounds` times, and the medians are printed.

    .venv/bin/python bench/warm_starts.py [--generations 3] [--processes 2] [--steps 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.launcher import SubprocessLauncher  # noqa: E402
from agent.warm_launcher import WarmLauncher  # noqa: E402
from proto.launch_env import GENERATION_ENV  # noqa: E402


def machine_cpu_s() -> float:
    """User + system time of every CPU since boot, in seconds."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    user, nice, system = (int(f) for f in fields[:3])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


async def run_variant(warm: bool, generations: int, processes: int, steps: int,
                      root: Path) -> tuple[list[float], float]:
    launcher = WarmLauncher(SubprocessLauncher(), python=sys.executable, log_path=root / "templates.log",
                            capacity=processes, enabled=warm)
    walls = []
    cpu_before = machine_cpu_s()
    try:
        for generation in range(1, generations + 1):
            starts = []
            for device in range(processes):
                out = root / f"g{generation}-d{device}"
                argv = [sys.executable, "-m", "trainer.examples.mlp", "--steps", str(steps), "--output", str(out)]
                env = {**os.environ, "DEVICE_ID": str(device), GENERATION_ENV: str(generation),
                       "GLOG_v": "3", "PYTHONPATH": str(REPO)}
                starts.append((argv, env, root / f"g{generation}-d{device}.log"))
            began = time.monotonic()
            for argv, env, _ in starts:
                await launcher.prepare(argv, env, root)
            handles = [await launcher.start(argv, env, root, log) for argv, env, log in starts]
            codes = await asyncio.gather(*(h.wait() for h in handles))
            walls.append(time.monotonic() - began)
            if any(codes):
                raise SystemExit(f"a process failed ({codes}): see {root}")
    finally:
        await launcher.close()
    return walls, machine_cpu_s() - cpu_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[tuple[list[float], float]]] = {"cold": [], "forked": []}
    for round_ in range(args.rounds):
        for name in (("cold", "forked") if round_ % 2 == 0 else ("forked", "cold")):
            with tempfile.TemporaryDirectory(prefix="trainerd-warm-starts-") as tmp:
                walls, cpu = asyncio.run(run_variant(name == "forked", args.generations, args.processes,
                                                     args.steps, Path(tmp)))
            results[name].append((walls, cpu))
            print(f"round {round_ + 1} {name:>6}: generations " + ", ".join(f"{w:.2f}" for w in walls)
                  + f" s; machine CPU {cpu:.1f} s", flush=True)
    print(f"\n{args.generations} generations x {args.processes} processes (mlp, {args.steps} steps), "
          f"medians of {args.rounds}:")
    print(f"{'':>8} {'first gen s':>12} {'later gens s':>13} {'all gens s':>11} {'machine CPU s':>14}")
    for name, runs in results.items():
        first = statistics.median(w[0] for w, _ in runs)
        later = statistics.median(statistics.mean(w[1:]) for w, _ in runs) if args.generations > 1 else 0.0
        total = statistics.median(sum(w) for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"{name:>8} {first:>12.2f} {later:>13.2f} {total:>11.2f} {cpu:>14.1f}")


if __name__ == "__main__":
    main()
