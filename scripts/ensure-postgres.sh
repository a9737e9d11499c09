#!/usr/bin/env bash
# The PostgreSQL catalog's tests (tests/pg.py) start a throwaway cluster from Debian's server
# binaries (/usr/lib/postgresql/<version>/bin): install the postgresql package where initdb is
# missing. The tests run the server as the package's postgres user when they run as root.
set -euo pipefail
if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    echo "PostgreSQL is missing (the catalog's PostgreSQL tests need it): installing postgresql with apt" >&2
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql
fi
