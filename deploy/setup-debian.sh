#!/usr/bin/env bash
# Installs rekv's build and run dependencies from Debian's packages (deploy/debian-packages.txt)
# and what `make test` uses beside them (deploy/debian-test-packages.txt: the boot test's virtual
# machine), as root or through sudo.
set -euo pipefail
cd "$(dirname "$0")/.."
run() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
export DEBIAN_FRONTEND=noninteractive
run apt-get update
run apt-get install -y --no-install-recommends $(cat deploy/debian-packages.txt) \
    $(cat deploy/debian-test-packages.txt)
