"""The help formatter of hearth's commands."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except the empty ones: "(default: None)" tells a reader
    nothing, and after a help text that says what an unset flag does ("default: all",
    "default: detected from the model") it contradicts it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default in ("", []):
            return action.help
        return super()._get_help_string(action)
