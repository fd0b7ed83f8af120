"""How busy the machine is while something is timed: the share of its CPUs other processes used.

On a shared machine a busy neighbour delays every multi-threaded op by whole scheduler ticks, so every
timing lightgen prints (the demo, the notebooks, the benchmarks) says how quiet the machine was instead of
leaving the reader to guess. Linux only (``/proc/stat``); elsewhere the share is unknown, and said so.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CONTENTION_WARNING = 0.1  # above this share of the CPUs used by other processes, timings are suspect


def machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (or stolen by the hypervisor) since boot."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU time of this process and of its finished children (benchmarks that time command-line tools)."""
    times = os.times()
    return time.process_time() + times.children_user + times.children_system


def format_share(share: float | None) -> str:
    return f"{share:.0%}" if share is not None else "an unknown share"


def busy(share: float | None) -> bool:
    return (share or 0) > CONTENTION_WARNING


class ContentionMeter:
    """Share of the machine's CPU capacity that other processes used since the meter started."""

    def __init__(self):
        self.machine_start = machine_busy_seconds()
        self.own_start = own_cpu_seconds()
        self.wall_start = time.perf_counter()

    def others_share(self) -> float | None:
        machine_end = machine_busy_seconds()
        if self.machine_start is None or machine_end is None:
            return None
        others = (machine_end - self.machine_start) - (own_cpu_seconds() - self.own_start)
        capacity = (time.perf_counter() - self.wall_start) * (os.cpu_count() or 1)
        return max(0.0, others / capacity)

    def record(self, env: dict) -> None:
        """Store the share and the wall time since the meter started in ``env``, for the header."""
        env["others_cpu_share"] = self.others_share()
        env["timing_seconds"] = time.perf_counter() - self.wall_start


def load_label(share: float | None) -> str:
    """One line to print (or put on a chart) beside timings taken while ``share`` of the CPUs was others'."""
    text = f"other processes used {format_share(share)} of the {os.cpu_count() or 1} CPUs while timing"
    if share is None:
        return text + ": the load is unknown, so treat the ratios with care"
    if busy(share):
        return text + ": BUSY MACHINE, the timings and ratios are unreliable (rerun when it is quiet)"
    return text + " (quiet)"
