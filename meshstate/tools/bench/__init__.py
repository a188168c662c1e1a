"""``meshstate bench``: a module per measurement; :mod:`~meshstate.tools.bench.report` runs
them and prints the report, and :mod:`~meshstate.tools.bench.settings` holds the defaults
the command line shows without importing torch."""
