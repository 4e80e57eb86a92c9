"""Entry point of one pool worker: ``python -m envs.textworlds.worker FD WORLD KWARGS_JSON CACHE_SIZE``."""

import json
import os
import sys
from multiprocessing.connection import Connection

from envs.textworlds.pool import worker_main

if __name__ == "__main__":
    worker_main(Connection(os.dup(int(sys.argv[1]))), sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))
