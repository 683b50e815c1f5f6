#!/usr/bin/env bash
# One bench command on two trees, alternating old and new for ROUNDS rounds, each tree first
# on PYTHONPATH over the same venv (the tree's compiled kernel copied in beside it):
#   bash benchmarks/trees.sh OLD_TREE NEW_TREE OUT_DIR ROUNDS [bench options...]
# Each run's table goes to OUT_DIR/{old,new}-R.txt and its --json to OUT_DIR/{old,new}-R.json.
set -euo pipefail
old=$1 new=$2 out=$3 rounds=$4
shift 4
python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
    for side in old new; do
        tree=${!side}
        echo "round $r: $side ($tree)" >&2
        PYTHONPATH="$tree" "$python" -c 'import sys; from streamsync.cli import main; sys.exit(main())' \
            bench "$@" --json "$out/$side-$r.json" >"$out/$side-$r.txt" 2>&1
    done
done
