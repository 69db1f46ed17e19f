"""``python -m kvdd.demo``: the same as ``kvdd demo`` (errors reported as by :mod:`kvdd.cli`)."""

from __future__ import annotations

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
