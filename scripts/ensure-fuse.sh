#!/usr/bin/env bash
# The power-loss tests (tests/torture, tests/faults/test_power_loss.py) mount a FUSE filesystem
# (slipstream/torture/_powerfs.py): install Debian's fuse3 (fusermount3) and libfuse3-3 where missing.
set -euo pipefail
missing=()
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
LDCONFIG="$(command -v ldconfig || echo /sbin/ldconfig)"
if ! "$LDCONFIG" -p 2>/dev/null | grep 'libfuse3\.so\.3' >/dev/null; then missing+=(libfuse3-3); fi
if [ "${#missing[@]}" -gt 0 ]; then
    echo "FUSE is missing (the power-loss tests need it): installing ${missing[*]} with apt" >&2
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q "${missing[@]}"
fi
