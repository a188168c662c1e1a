"""``from meshstate import parallel_state``: the same module as :mod:`meshstate.megatron.parallel_state`."""

import sys

from meshstate.megatron import parallel_state as _module
from meshstate.megatron.parallel_state import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
