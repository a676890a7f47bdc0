#!/usr/bin/env bash
# Screenshot a doctor HTML report with headless Chromium: scripts/screenshot_report.sh REPORT.html OUT.png [WxH]
# The report is self-contained, so the browser is kept fully offline (no network, no profile, no updates).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 REPORT.html OUT.png [WIDTHxHEIGHT]" >&2
    exit 2
fi
report=$1
out=$2
size=${3:-1280x1800}
if [ ! -f "$report" ]; then
    echo "$0: $report does not exist" >&2
    exit 2
fi

browser=""
for name in chromium chromium-browser google-chrome; do
    if command -v "$name" >/dev/null 2>&1; then
        browser=$name
        break
    fi
done
if [ -z "$browser" ] && command -v apt-get >/dev/null 2>&1; then
    echo "$0: no Chromium found; trying apt-get install -y chromium" >&2
    apt-get install -y chromium >/dev/null 2>&1 || true
    command -v chromium >/dev/null 2>&1 && browser=chromium
fi
if [ -z "$browser" ]; then
    echo "$0: needs chromium (apt-get install chromium)" >&2
    exit 2
fi

profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
abs_report=$(cd "$(dirname "$report")" && pwd)/$(basename "$report")
out_dir=$(cd "$(dirname "$out")" && pwd)
tmp_png="$out_dir/.$(basename "$out").tmp.png"

"$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --hide-scrollbars --user-data-dir="$profile" \
    --screenshot="$tmp_png" --window-size="${size/x/,}" "file://$abs_report" >/dev/null 2>&1

if [ ! -s "$tmp_png" ]; then
    rm -f "$tmp_png"
    echo "$0: $browser wrote no screenshot" >&2
    exit 1
fi
mv -f "$tmp_png" "$out"
echo "$out"
