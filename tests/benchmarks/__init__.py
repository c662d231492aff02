"""The performance benchmark of taskiq-deduplication (issue 5).

Run it from the repository root::

    python -m tests.benchmarks            # the full run, about 3 minutes
    python -m tests.benchmarks --quick    # a smoke run of a few seconds
    python -m tests.benchmarks --repeat 3 --plot --profile   # the figures in docs/performance.md

It measures this middleware and taskiq without any middleware side by side, on
the same Redis, in interleaved rounds, and prints a table, writes JSON
(``benchmark-results/latest.json`` by default) and, with ``--plot``, the charts
in ``docs/images/``. Nothing here is collected by pytest: no module is named
``test_*.py``.
"""
