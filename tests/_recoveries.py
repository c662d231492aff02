"""The recovery times that the fault tests measure, printed at the end of the run.

A fault test records one with the ``recovery`` fixture (``tests/faults/conftest.py``)
as a user property of its report; ``tests/conftest.py``'s hooks collect them from
the reports and print them in the terminal summary.
"""

from __future__ import annotations

from typing import cast

import pytest

#: The name of the user property under which a fault test reports a recovery time.
RECOVERY_PROPERTY = "dedup_recovery"

_RECOVERIES: list[tuple[str, str, float]] = []


def collect(report: pytest.TestReport) -> None:
    """Keep the recovery times that ``report``'s test measured.

    Under pytest-xdist this runs in the controller with the reports the workers
    send, so the summary has the measurements of every worker.
    """
    if report.when != "call":
        return
    for name, value in report.user_properties:
        if name == RECOVERY_PROPERTY:
            what, seconds = cast("tuple[str, float]", value)
            _RECOVERIES.append((report.nodeid.rsplit("::", 1)[-1], str(what), float(seconds)))


def print_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the recovery times kept, if any, in a section of their own."""
    if not _RECOVERIES:
        return
    terminalreporter.section("fault recovery times")
    for test, what, seconds in _RECOVERIES:
        terminalreporter.write_line(f"{seconds * 1000:9.0f} ms  {what}  [{test}]")
