#!/usr/bin/env bash
# Vendor the console's two browser libraries from the npm registry into
# slipstream/console/static/vendor/ and record name, version, tarball and sha256 of every file
# in static/vendor/VERSIONS. The files are committed: a fresh machine needs no npm. Run it
# again (with other versions: HTMX=2.0.9 UPLOT=1.6.32 scripts/vendor-ui.sh) to upgrade.
set -euo pipefail
cd "$(dirname "$0")/.."
HTMX="${HTMX:-2}"     # htmx 2.x: hx-get/hx-trigger="every 2s"/hx-swap as the templates use them
UPLOT="${UPLOT:-1}"
dest=slipstream/console/static/vendor
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fetch() {  # package, version range -> unpacked in $work/<package>/package
    local name=$1 range=$2
    local version tarball
    version=$(npm view "$name@$range" version --json | python3 -c '
import json, sys
v = json.load(sys.stdin)
v = v if isinstance(v, list) else [v]
print(max(v, key=lambda s: [int(p) for p in s.split("-")[0].split(".")]))')
    tarball=$(npm view "$name@$version" dist.tarball)
    mkdir -p "$work/$name"
    curl -fsSL "$tarball" -o "$work/$name.tgz"
    tar -xzf "$work/$name.tgz" -C "$work/$name"
    echo "$name $version $tarball" >> "$work/packages"
}

fetch htmx.org "$HTMX"
fetch uplot "$UPLOT"
mkdir -p "$dest"
cp "$work/htmx.org/package/dist/htmx.min.js" "$dest/htmx.min.js"
cp "$work/uplot/package/dist/uPlot.iife.min.js" "$dest/uPlot.iife.min.js"
cp "$work/uplot/package/dist/uPlot.min.css" "$dest/uPlot.min.css"
cp "$work/uplot/package/LICENSE" "$dest/uPlot.LICENSE"
cp "$work/htmx.org/package/LICENSE" "$dest/htmx.LICENSE"
{
    echo "# Vendored by scripts/vendor-ui.sh from the npm registry; do not edit by hand."
    echo "# package version tarball"
    cat "$work/packages"
    echo "# sha256 file"
    (cd "$dest" && sha256sum htmx.min.js htmx.LICENSE uPlot.iife.min.js uPlot.min.css uPlot.LICENSE)
} > "$dest/VERSIONS"
cat "$dest/VERSIONS"
