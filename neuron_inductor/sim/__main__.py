"""`python -m neuron_inductor.sim SCRIPT.py [ARGS]`: run a script written for real NKI on the interpreter."""

from __future__ import annotations

import runpy
import sys

from .shim import as_nki


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m neuron_inductor.sim SCRIPT.py [ARGS...]", file=sys.stderr)
        return 2
    sys.argv = list(argv)
    with as_nki():
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
