"""End-to-end throughput of each transport against memcpy and raw pyzmq: now
``streamsync bench`` (:mod:`streamsync.cli.bench`); this script runs it with the same options.

    .venv/bin/python benchmarks/transports.py                       # = streamsync bench
    .venv/bin/python benchmarks/transports.py --transport shm --size 256MiB --runs 2
"""

from __future__ import annotations

import sys

from streamsync.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
