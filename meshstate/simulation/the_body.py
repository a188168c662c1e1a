"""Where a simulated body is: its frame, its line, and whether it is testing an ``assert``.

The simulation answers for the body's own code (the test, or megatron-core it
calls), not for torch's or meshstate's, which work as the process (rank 0);
its refusals name the body's line (``at tests/test_model.py:12 (if rank == 0:)``).
"""

from __future__ import annotations

import dis
import linecache
import os
import sys
from types import FrameType


_LIBRARIES = ("torch", "meshstate")
"""Packages whose modules work as the process (rank 0), whose groups they hold."""


def from_a_library(caller: FrameType) -> bool:
    """Whether ``caller`` runs code of torch or meshstate, not the body's."""
    return str(caller.f_globals.get("__name__", "")).partition(".")[0] in _LIBRARIES


def the_bodys_line() -> str:
    """Where the running body (or the code it called: megatron-core, a test helper) reached
    torch or meshstate: ``" at file.py:12 (x = W[t])"``, ``""`` if nothing but libraries runs."""
    frame = _the_bodys_frame()
    if frame is None:
        return ""
    path = frame.f_code.co_filename
    source = linecache.getline(path, frame.f_lineno).strip()
    shown = path.partition("site-packages" + os.sep)[2] or os.path.relpath(path)
    return f" at {shown}:{frame.f_lineno}" + (f" ({source})" if source else "")


def _the_bodys_frame() -> FrameType | None:
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (from_a_library(frame) or frame.f_code.co_filename.startswith(_STDLIB)):
        frame = frame.f_back
    return frame


def failing_an_assert(values: dict[int, bool]) -> list[int]:
    """The ranks on which the ``assert`` whose test the body is asking of ``values`` fails:
    those whose jump leads to raising ``AssertionError`` (Python's ``LOAD_ASSERTION_ERROR``,
    or pytest's rewritten assert, a block that raises ``AssertionError``). None where the
    body is not testing an ``assert``, or not with ``values`` alone (``assert a and b``)."""
    frame = _the_bodys_frame()
    if frame is None:
        return []
    code = [i for i in dis.get_instructions(frame.f_code) if i.opname not in ("EXTENDED_ARG", "TO_BOOL")]
    at = next((n for n, instruction in enumerate(code) if instruction.offset >= frame.f_lasti), len(code))
    jump = code[at] if at < len(code) else None
    if jump is None or not jump.opname.startswith("POP_JUMP") or not jump.opname.endswith(("IF_TRUE", "IF_FALSE")):
        return []
    taken_when = jump.opname.endswith("IF_TRUE")

    def raises(start: int, end: int | None) -> bool:
        block = [i for i in code if i.offset >= start and (end is None or i.offset < end)]
        return bool(block) and (block[0].opname == "LOAD_ASSERTION_ERROR" or end is not None and (
            block[-1].opname == "RAISE_VARARGS" and any(i.argval == "AssertionError" for i in block)))

    if at + 1 < len(code) and raises(code[at + 1].offset, jump.argval if jump.argval > jump.offset else None):
        return [rank for rank, value in values.items() if value != taken_when]
    if raises(jump.argval, None):
        return [rank for rank, value in values.items() if value == taken_when]
    return []


_STDLIB = os.path.dirname(os.__file__) + os.sep
