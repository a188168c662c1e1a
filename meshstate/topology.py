"""``meshstate.topology``: the same module as :mod:`meshstate.tools.topology`."""

import sys

from meshstate.tools import topology as _module
from meshstate.tools.topology import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
