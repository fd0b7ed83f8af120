"""The load check printed beside every timing: other processes' share of the CPUs, labelled."""

import os

from lightgen import machine


def test_load_label_says_quiet_busy_or_unknown():
    cpus = os.cpu_count()
    assert machine.load_label(0.02) == f"other processes used 2% of the {cpus} CPUs while timing (quiet)"
    assert "BUSY MACHINE, the timings and ratios are unreliable" in machine.load_label(0.6)
    assert "60%" in machine.load_label(0.6)
    assert "an unknown share" in machine.load_label(None) and "with care" in machine.load_label(None)
    assert machine.busy(0.6) and not machine.busy(0.05) and not machine.busy(None)


def test_contention_meter_counts_only_other_processes():
    """Our own busy loop is not 'other processes': the share stays within [0, 1] and is known on Linux."""
    meter = machine.ContentionMeter()
    total = 0
    for i in range(2_000_000):
        total += i
    share = meter.others_share()
    if machine.machine_busy_seconds() is None:  # not Linux
        assert share is None
    else:
        assert 0.0 <= share <= 1.0
