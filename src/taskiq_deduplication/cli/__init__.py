"""``taskiq dedup``: the locks from the command line (list, show, release, key, web).

`commands.py` parses the command line and runs each command; `text.py` prints
a lock (its table row, ``show``, JSON). Every ``taskiq`` command loads this
package (an entry point), so what a command needs is imported when it runs.
"""

from taskiq_deduplication.cli.commands import DedupCMD, ExitCode, main

__all__ = ["DedupCMD", "ExitCode", "main"]
