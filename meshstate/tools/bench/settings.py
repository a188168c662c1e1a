"""What ``meshstate bench`` runs unless told otherwise, readable without importing torch.

The command line's ``--help`` shows these numbers; :mod:`meshstate.tools.bench` uses them.
"""

from __future__ import annotations

from typing import Any

PROCESS_SIZES = dict(tp=2, cp=2, pp=2, ep=2, etp=1)
"""The layout timed on real local processes unless told otherwise."""
MAX_FAKE_WORLD = 2**22
"""The largest fake world one rank stands in (meshstate's init does not grow with it)."""
MAX_SIMULATED_CHECK = 2**17
"""The largest world ``check --simulate`` builds: it holds every rank's tables and a
tensor per rank and collective (16,384 ranks take about 35 s and 0.9 GB on two cores)."""
SIMULATED_CHECK_SIZES: dict[str, Any] = dict(tp=2, cp=2, pp=2)
"""The layout ``bench`` times ``check --simulate`` with, at every world size."""
SIMULATED_CHECK_WORLDS = "8,1024,16384"
"""The worlds ``bench`` times ``check --simulate`` at unless told otherwise."""
SIMULATED_PIPELINE_SIZES: dict[str, Any] = dict(tp=8, pp=4)
"""The layout ``bench`` times one 1F1B step with, simulated stage by stage (dp inferred)."""
SIMULATED_PIPELINE_WORLD = 1024
"""The world ``bench`` times the 1F1B step at unless told otherwise."""
COMPILE_SIZES: dict[str, Any] = dict(tp=2, cp=2, pp=2)
"""The layout ``bench`` compiles a training step on, every rank and one for all (dp inferred)."""
CHECKPOINT_SIZES: dict[str, Any] = dict(tp=2)
"""The layout ``bench`` saves and loads checkpoints on (dp inferred; blocks split over both)."""
CHECKPOINT_WORLDS = "4"
"""The local worlds ``bench`` times checkpoints on unless told otherwise."""
CHECKPOINT_RUNS = 12
"""The fewest timed runs of each checkpoint writer (``--repeat`` asks for more): a ratio is
the median of each run's seconds over DCP's, which three runs leave to one busy spell
of a shared machine (0.73-0.96x for the same code in three bench runs). Twice the six
orders of three writers, which the runs take in turn."""
CHECKPOINT_LAYERS, CHECKPOINT_BLOCK = 8, 512
"""Each rank's blocks: this many layers of two float32 blocks of this many rows and columns
(8 layers of 512 x 512: 16 MiB a rank)."""
