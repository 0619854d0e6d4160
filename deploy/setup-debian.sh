#!/usr/bin/env bash
# Installs rekv's build and run dependencies from Debian's packages (deploy/debian-packages.txt)
# and what `make test` uses beside them (deploy/debian-test-packages.txt: the boot test's virtual
# machine, and the openai npm client its HTTP test drives), as root or through sudo.
set -euo pipefail
cd "$(dirname "$0")/.."
run() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
export DEBIAN_FRONTEND=noninteractive
run apt-get update
run apt-get install -y --no-install-recommends $(cat deploy/debian-packages.txt) \
    $(cat deploy/debian-test-packages.txt)
# the official openai npm client that tests/test_http_openai.c drives (as the user, not root:
# node_modules stays theirs); node and npm from Debian when the machine has none
command -v npm >/dev/null || run apt-get install -y --no-install-recommends nodejs npm
(cd tests/openai && npm ci --no-audit --no-fund)
