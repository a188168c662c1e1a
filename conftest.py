"""What pytest collects from the package (``--doctest-modules``): the torch-checkpointing
backend only where its optional package is installed (``meshstate[checkpointing]``);
without it the module refuses to import, by design."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("torch_checkpointing") else ["meshstate/checkpoint/checkpointing.py"]
