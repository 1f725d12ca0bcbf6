"""Where a run's start-up time goes: seconds since the process started at each milestone.

    clock = StartupClock()        # anywhere in the process; time zero is the process's own start
    clock.mark("config")          # config read and validated (Python imports included)
    clock.mark("ray")             # Ray up (an embedded cluster started, or the job's cluster joined)
    clock.mark("workers_ready")   # every rollout worker constructed: tokenizer, model, engine
    clock.mark("first_episode")   # the first finished episode reached the driver

`odyssey rollout` writes the marks to summary.json ("startup_s") and prints them; bench/startup.py reads them
to split a submitted job's start-up from a local run's (docs/quickstart.md, "Start-up").
"""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """When this process was created, epoch seconds. On Linux from /proc (10 ms ticks since boot against
    /proc/uptime; psutil's create_time rounds the boot time to whole seconds), else psutil's."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux
        import psutil  # installed with trl / accelerate

        return psutil.Process().create_time()


class StartupClock:
    """Milestone name -> seconds since this process was created (the first mark of a name wins)."""

    def __init__(self) -> None:
        self.process_start = process_start_time()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, round(time.time() - self.process_start, 2))

    def line(self) -> str:
        """"start-up: config 2.4 s, ray 5.1 s, ..." (cumulative, since the process started)."""
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in self.marks.items())
        return f"start-up (since the process started): {parts}"
