"""What a deployment step did to one AWS resource.

Every ``ensure_*`` / ``delete_*`` function returns :class:`Result` values instead of printing,
so the CLI prints exactly one line per resource and tests can assert on what happened
(a rerun of the same command must report ``unchanged`` everywhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Report", "Result", "Results", "Status", "ignore"]


class Status(StrEnum):
    """The outcome vocabulary of every command."""

    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"
    DELETED = "deleted"
    ABSENT = "absent"  # asked to delete something that does not exist


@dataclass(frozen=True)
class Result:
    """One resource and what happened to it, e.g. ``endpoint demo: created``."""

    kind: str
    name: str
    status: Status
    detail: str = ""

    def line(self) -> str:
        """The single line the CLI prints for this resource."""
        text = f"{self.kind} {self.name}: {self.status.value}"
        return f"{text} ({self.detail})" if self.detail else text


Report = Callable[[Result], None]
"""Where results go as they happen (the CLI prints each as one line)."""


def ignore(_result: Result) -> None:
    """The default :data:`Report`: library callers that only want the returned list."""
    return None


class Results:
    """Keeps results in order and hands each to ``report`` the moment it exists.

    Creating or deleting an endpoint takes minutes; the user should see
    ``endpoint demo: created`` before the wait, not after it.
    """

    def __init__(self, report: Report) -> None:
        self.items: list[Result] = []
        self._report = report

    def add(self, result: Result) -> Result:
        self.items.append(result)
        self._report(result)
        return result
