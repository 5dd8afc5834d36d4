#!/usr/bin/env bash
# Regenerate the manual's screenshots in docs/img/ (run by hand, not by the test suite): build the site, serve it on
# localhost, and let headless Chromium (Debian's `chromium` package: apt-get install -y chromium) photograph the home
# page and the budget's page, so a reader of the repository sees what the manual looks like.
#   bash scripts/screenshots.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
browser="$(command -v chromium || command -v chromium-browser || true)"
[ -n "$browser" ] || { echo "no chromium on PATH. HINT: apt-get install -y chromium" >&2; exit 1; }
site="$(mktemp -d)"
profile="$(mktemp -d)"  # a fresh profile: no first-run pages, nothing of the user's
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"
port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
python -m http.server "$port" --bind 127.0.0.1 --directory "$site" > /dev/null 2>&1 &
server=$!
trap 'kill "$server"; rm -rf "$site" "$profile"' EXIT
for _ in $(seq 50); do  # until the server answers (at most 5 s)
  python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2> /dev/null && break
  sleep 0.1
done
shoot() {  # shoot PAGE PNG: one page at a laptop's window size
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$profile" \
    --window-size=1280,900 --virtual-time-budget=3000 --screenshot="$2" "http://127.0.0.1:$port/$1" 2> /dev/null
  echo "wrote $2"
}
shoot "" docs/img/manual_home.png
shoot "memory_and_time/" docs/img/manual_budget.png
