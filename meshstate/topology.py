"""``meshstate.topology``: the same module as :mod:`meshstate.core.topology`."""

import sys

from meshstate.core import topology as _module
from meshstate.core.topology import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
