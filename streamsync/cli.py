"""The ``streamsync`` command: ``demo`` (the main job) and ``bench``, each in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamsync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("demo", "bench"):
        try:
            module = importlib.import_module(f"streamsync.{name}")
        except ModuleNotFoundError as exc:  # a subcommand still being written
            if exc.name != f"streamsync.{name}":
                raise
            continue
        module.add_parser(sub)
    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
