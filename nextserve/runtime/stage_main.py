"""Entry point of a pipeline stage process: `python -m nextserve.runtime.stage_main`, its StageSetup
pickled on stdin (runtime/pipeline.py starts it)."""

import pickle
import sys

from .pipeline import stage_main

if __name__ == "__main__":
    stage_main(pickle.loads(sys.stdin.buffer.read()))
