#!/usr/bin/env bash
# Spark needs Java 17: install Debian's openjdk-17-jre-headless where `java` is missing.
set -euo pipefail
if ! command -v java >/dev/null 2>&1; then
    echo "Java is missing (Spark needs Java 17): installing openjdk-17-jre-headless with apt" >&2
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q openjdk-17-jre-headless
fi
