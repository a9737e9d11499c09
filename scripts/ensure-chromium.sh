#!/usr/bin/env bash
# The console's browser tests (tests/console) drive Debian's Chromium through Playwright
# (nothing downloaded by Playwright): install the chromium package where /usr/bin/chromium is
# missing.
set -euo pipefail
if [ ! -x /usr/bin/chromium ]; then
    echo "Chromium is missing (the console's browser tests need it): installing chromium with apt" >&2
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q chromium
fi
