"""``python -m meshstate``: the same as the ``meshstate`` command."""

from meshstate.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
