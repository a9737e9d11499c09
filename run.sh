#!/usr/bin/env bash
# Set up a virtual environment (.venv) and run the main job: the live auctions pipeline
# (examples/auctions) on the embedded default: a broker with local files + SQLite in
# ./.slipstream/auctions, a bid generator, two chained Spark jobs and a live view. Ctrl-C stops
# everything cleanly; running it again resumes from the checkpoints.
# Extra arguments go to 'python -m auctions live', e.g. ./run.sh --rate 2000 --duration 120
set -euo pipefail
cd "$(dirname "$0")"
scripts/ensure-java.sh
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -U pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[spark]"
cd examples
exec ../.venv/bin/python -m auctions live --data-dir ../.slipstream/auctions "$@"
