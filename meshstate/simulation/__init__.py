"""Every rank of a world in one process: per-rank values, each rank's mesh answers, and the
``LocalTensorMode`` compatibility. Imported, it plugs itself into the runtime's seam
(:mod:`meshstate.core.world`); nothing below imports it.
"""

from meshstate.core import world as _world
from meshstate.simulation.answers import LocalTensorSimulation as _LocalTensorSimulation

_world.plug(_LocalTensorSimulation())
