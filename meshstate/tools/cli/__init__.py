"""The ``meshstate`` command: :mod:`~meshstate.tools.cli.program` is its entry point (``main``),
:mod:`~meshstate.tools.cli.parser` its arguments (no torch), and
:mod:`~meshstate.tools.cli.plan` and :mod:`~meshstate.tools.cli.commands` what each command runs."""

from meshstate.tools.cli.program import main

__all__ = ["main"]
