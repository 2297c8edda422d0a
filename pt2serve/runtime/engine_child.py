"""The engine process's entry point: `python -m pt2serve.runtime.engine_child FD` (engine_process.py starts it).

A module of its own, so that what the engine pickles back names engine_process's classes, not __main__'s.
"""

import sys
from multiprocessing.connection import Connection

from pt2serve.runtime.engine_process import run_engine

if __name__ == "__main__":
    run_engine(Connection(int(sys.argv[1])))
