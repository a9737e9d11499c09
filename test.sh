#!/usr/bin/env bash
# Set up a virtual environment (.venv) and run every check: lint, types, the whole test suite.
# Extra arguments go to pytest, e.g. ./test.sh tests/integration -x
set -euo pipefail
cd "$(dirname "$0")"
scripts/ensure-java.sh
scripts/ensure-fuse.sh
scripts/ensure-chromium.sh
scripts/ensure-postgres.sh
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -U pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,dev]"
.venv/bin/ruff check slipstream tests bench examples
.venv/bin/ruff format --check slipstream tests bench examples
.venv/bin/mypy
.venv/bin/pytest "$@"
