#!/usr/bin/env bash
# Runs every test program given, one after another; exit code 77 means "skipped". Fails if any
# test fails. Prints a line as each program starts ([N/M]), each case as it ends (Check's log to
# stdout, CK_LOG_FILE_NAME=-, unless the caller names another file), each program's time, and at
# the end the slowest programs — so that `make test` is never silent for long.
set -u
cd "$(dirname "$0")/.." || exit 2
# caches the programs write (profiles) go to a private directory, removed at the end
XDG_CACHE_HOME=$(mktemp -d -t rekv-test-cache.XXXXXX) || exit 2
export XDG_CACHE_HOME
export CK_LOG_FILE_NAME=${CK_LOG_FILE_NAME:--}
# where a long case's helpers (tests/vm.sh) say how far they are, past the test's own capture of
# their output: this script's stdout when it is a pipe or a terminal (reopened, a regular file's
# offset would not be shared: lines would be overwritten)
if [ -z "${REKV_TEST_PROGRESS:-}" ] && { [ -p /dev/stdout ] || [ -t 1 ]; }; then
    export REKV_TEST_PROGRESS=/proc/$$/fd/1
fi
trap 'rm -rf "$XDG_CACHE_HOME"' EXIT
failed=()
times=()
total=$#
n=0
all_start=$(date +%s)
for t in "$@"; do
    n=$((n + 1))
    printf '== [%d/%d] %s (%s)\n' "$n" "$total" "$(basename "$t")" "$(date +%H:%M:%S)"
    start=$(date +%s)
    "$t"
    rc=$?
    took=$(($(date +%s) - start))
    times+=("$took $(basename "$t")")
    case $rc in
        0) printf '   ok (%ss)\n' "$took" ;;
        77) printf '   skipped (%ss)\n' "$took" ;;
        *) printf '   FAILED (exit %s, %ss)\n' "$rc" "$took"; failed+=("$(basename "$t")") ;;
    esac
done
printf '%d programs in %ss; the slowest:' "$total" "$(($(date +%s) - all_start))"
printf '%s\n' "${times[@]}" | sort -rn | head -n 10 | awk '{printf " %s %ss,", $2, $1}' | sed 's/,$//'
echo
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all tests passed"
