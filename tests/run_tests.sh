#!/usr/bin/env bash
# Runs every test program given; exit code 77 means "skipped". Fails if any test fails.
set -u
cd "$(dirname "$0")/.." || exit 2
# caches the programs write (profiles) go to a private directory, removed at the end
XDG_CACHE_HOME=$(mktemp -d -t rekv-test-cache.XXXXXX) || exit 2
export XDG_CACHE_HOME
trap 'rm -rf "$XDG_CACHE_HOME"' EXIT
failed=()
for t in "$@"; do
    printf '== %s\n' "$(basename "$t")"
    start=$(date +%s)
    "$t"
    rc=$?
    took=$(( $(date +%s) - start ))
    case $rc in
        0) printf '   ok (%ss)\n' "$took" ;;
        77) printf '   skipped\n' ;;
        *) printf '   FAILED (exit %s)\n' "$rc"; failed+=("$(basename "$t")") ;;
    esac
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all tests passed"
