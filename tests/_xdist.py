"""Running the suite in parallel (pytest-xdist, ``pytest -n auto``): groups, and long tests first.

Every test of an ``xdist_group`` runs in one worker: the docs examples (whose
module fixture starts every selected example at once), the Cluster and the
Sentinel set (one of each for the run), the browser. pytest-xdist's own
``--dist loadgroup`` tells the controller each test's group by renaming the test
in the worker (an ``@group`` suffix on its node id), which pytest 9.2 no longer
sees (pytest-dev/pytest-xdist#1386): every test then became a group of its own,
and each of the four workers started every docs example, a Cluster, a Sentinel
set and a browser. Here the workers write each grouped test's group to a file
that the controller's scheduler reads instead; the groups are started first,
the largest first (pytest-xdist's ``loadscope`` order).

The other tests follow in the order the workers collected them, with the ones
marked ``slow`` (tens of seconds each: a TTL waited out, real worker processes)
put first, so that none of them starts last and ends the run alone.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

#: How the controller tells a worker where to write the groups.
GROUPS_FILE = "dedup_groups_file"
_GROUPS_KEY = pytest.StashKey[Path]()


def group_of(item: pytest.Item) -> str | None:
    """The group of ``item``, as pytest-xdist names it: its groups' names, sorted and joined."""
    names = {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    }
    return "_".join(sorted(names)) or None


def configure(config: pytest.Config) -> None:
    """In the controller of a ``-n`` run (``--dist load`` or ``loadgroup``): a groups file."""
    if hasattr(config, "workerinput"):
        return
    if getattr(config.option, "dist", None) in {"load", "loadgroup"}:
        config.stash[_GROUPS_KEY] = Path(tempfile.mkdtemp(prefix="dedup-xdist-")) / "groups.json"


def unconfigure(config: pytest.Config) -> None:
    """Remove the controller's file of groups."""
    path = config.stash.get(_GROUPS_KEY, None)
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)


def configure_node(node: Any) -> None:
    """Tell a worker where to write the groups (``pytest_configure_node``)."""
    path = node.config.stash.get(_GROUPS_KEY, None)
    if path is not None:
        node.workerinput[GROUPS_FILE] = str(path)


def reorder_and_record(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker: put the ``slow`` tests first, and write every grouped test's group."""
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    # A stable sort: every worker collects the same list in the same order.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    path = workerinput.get(GROUPS_FILE)
    if path is None:
        return
    groups = {item.nodeid: group for item in items if (group := group_of(item)) is not None}
    # Every worker writes the same file; a rename replaces it whole.
    partial = Path(f"{path}.{workerinput['workerid']}")
    partial.write_text(json.dumps(groups), "utf-8")
    partial.replace(path)


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The scheduler of a ``-n`` run with a file of groups (``pytest_xdist_make_scheduler``)."""
    found = config.stash.get(_GROUPS_KEY, None)
    if found is None:
        return None
    path = found
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415 (only with pytest-xdist)

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """``loadscope`` scheduling whose scopes are the groups the workers wrote."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            # Called once the workers have sent their collections: each wrote
            # the file before it sent its own.
            if self.groups is None:
                self.groups = json.loads(path.read_text("utf-8"))
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)
