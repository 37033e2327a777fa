"""``python -m specfw.kernels``: build (or load from the cache) this CPU's kernels (scripts/setup.sh)."""

import logging

from . import build_all

logging.basicConfig(level=logging.INFO, format="%(message)s")
print("specfw CPU kernels:", build_all())
