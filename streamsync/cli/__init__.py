"""The ``streamsync`` command: builds the parser from the subcommand modules and runs the
chosen one; each subcommand's options and work live in its own module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from streamsync.cli import demo
from streamsync.cli.bench import command as bench

#: The modules whose ``add_parser(subparsers)`` registers a subcommand that sets ``run``.
SUBCOMMANDS = (demo, bench)

DESCRIPTION = "Stream model weights from an RL trainer into inference engines."


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run the subcommand; its exit status."""
    parser = argparse.ArgumentParser(prog="streamsync", description=DESCRIPTION)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
