"""argparse for every console script: each option's help ends with its default, and a usage error
is one line."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says what its default
    is; a switch that is off unless given says "(default: off)". Options whose default is None
    must say in words what happens when they are left out (tests/test_help.py checks this)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.required or action.default is argparse.SUPPRESS
                or "default" in text.lower() or action.default is None):
            return text
        if action.default is False and action.nargs == 0:
            return f"{text} (default: off)"
        if action.default == "":
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (the full usage is in --help)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
