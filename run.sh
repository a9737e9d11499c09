#!/usr/bin/env bash
# Set up a virtual environment (.venv) and run the main job: the broker on the embedded
# default (local files + SQLite in ./.slipstream) with a live demo pipeline. Ctrl-C stops it.
# Extra arguments go to 'slipstream demo', e.g. ./run.sh --rate 2000
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -U pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
exec .venv/bin/slipstream demo "$@"
