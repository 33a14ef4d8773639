"""python -m pipeline.cache gc|list (pipeline/cache/gc.py)."""

import sys

from pipeline.cache.gc import main

main(sys.argv[1:])
