"""What the tests read from the docs, so that a page and its test cannot drift apart."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
#: The key prefix that the pages' commands are written for (the default one).
DOCUMENTED_PREFIX = "taskiq:deduplication"
_SETUSER = re.compile(r"ACL SETUSER (?P<rules>.*)")


@dataclass(frozen=True)
class DocumentedAcl:
    """An ``ACL SETUSER`` command of a page: its key patterns and its commands."""

    user: str
    key_patterns: tuple[str, ...]
    commands: tuple[str, ...]
    other_rules: tuple[str, ...]

    def rules(
        self, key_prefix: str, password: str, commands: tuple[str, ...] | None = None
    ) -> list[str]:
        """The rules for a user of ``key_prefix`` and ``password``, with only ``commands``."""
        kept = self.commands if commands is None else commands
        return [
            *(
                r.replace(DOCUMENTED_PREFIX, key_prefix, 1)  # a channel pattern ("&...")
                for r in self.other_rules
                if not r.startswith(">")
            ),
            f">{password}",
            *(p.replace(DOCUMENTED_PREFIX, key_prefix, 1) for p in self.key_patterns),
            *(f"+{c}" for c in kept),
        ]


def documented_acl(page: str) -> DocumentedAcl:
    """The first ``ACL SETUSER`` command on ``docs/<page>``, as a shell would split it."""
    text = (DOCS / page).read_text("utf-8").replace("\\\n", " ")
    found = _SETUSER.search(text)
    assert found is not None, f"docs/{page} has no ACL SETUSER command"
    user, *rules = shlex.split(found["rules"])
    patterns = tuple(r for r in rules if r.startswith("~"))
    assert all(p.startswith(f"~{DOCUMENTED_PREFIX}") for p in patterns), patterns
    return DocumentedAcl(
        user=user,
        key_patterns=patterns,
        commands=tuple(r[1:] for r in rules if r.startswith("+")),
        other_rules=tuple(r for r in rules if not r.startswith(("~", "+"))),
    )
