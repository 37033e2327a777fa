"""``python -m specfw.tp RANK WORLD PORT BACKEND THREADS SHM``: a follower rank started by ``launch.start_leader``."""

import sys

from .launch import follower_main

follower_main(sys.argv[1:])
