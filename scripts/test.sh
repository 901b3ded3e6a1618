#!/usr/bin/env bash
# Install everything the tests need on a fresh machine, then run them.
# This is the README's test command and exactly what .ci/run runs.
set -euo pipefail
cd "$(dirname "$0")/.."

# Headless Chromium for the browser tests (dashboards, JupyterLab; Debian's package; they skip without it).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "warning: could not install chromium; the browser test will be skipped"
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
# The suite runs on as many pytest-xdist workers as the machine has cores, at most 4 (each
# worker holds the real model, about 3 GB): CI's 2 cores run it in about half the serial time.
workers=$(( $(nproc) < 4 ? $(nproc) : 4 ))
exec .venv/bin/python -m pytest -q -n "$workers" "$@"
