"""The ``meshstate`` command and what only it needs (verification, locality, the benchmark)."""
