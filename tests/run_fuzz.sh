#!/usr/bin/env bash
# Runs the sanitizer-built parser fuzzer (tests/fuzz_parsers.c) in two parallel shards, printing
# each shard's lines as they come.
# Usage: tests/run_fuzz.sh PATH/TO/fuzz_parsers [extra driver arguments, e.g. --scale 4]
# Fails when any shard crashes, hangs (15 min: a guard, not a budget; a shard takes ~2-4 min on
# two shared cores) or reports a sanitizer error; the log names the mutant and
# how to replay it (--only SEED:ITER).
set -u
cd "$(dirname "$0")/.." || exit 2
bin=${1:?usage: run_fuzz.sh FUZZ_BINARY [ARGS...]}
shift
shards=${FUZZ_SHARDS:-2}
# Allocations the parsers size from file contents must fail cleanly, not exhaust the machine.
export ASAN_OPTIONS=${ASAN_OPTIONS:-allocator_may_return_null=1:max_allocation_size_mb=2048:detect_leaks=1:abort_on_error=1:print_summary=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:abort_on_error=1}
logdir=$(mktemp -d "${TMPDIR:-/tmp}/rekv-fuzz-log.XXXXXX")
start=$(date +%s)
echo "fuzz: $shards shards of $bin${*:+ $*} (a line per seed as it ends, [shard] first)"
pids=()
for ((i = 0; i < shards; i++)); do
    # each shard's lines as they come, marked with its number; the log and the exit status kept
    { timeout 900 "$bin" --shard "$i/$shards" "$@" 2>&1; echo $? >"$logdir/rc$i"; } |
        tee "$logdir/shard$i.log" | sed -u "s|^|  [$i] |" &
    pids+=($!)
done
failed=0
for ((i = 0; i < shards; i++)); do
    wait "${pids[$i]}"
    rc=$(cat "$logdir/rc$i" 2>/dev/null || echo 1)
    if [ "$rc" -ne 0 ]; then
        failed=1
        echo "fuzz: shard $i/$shards FAILED (exit $rc)$([ "$rc" -eq 124 ] && echo ', timed out'); its log's end:"
        tail -n 60 "$logdir/shard$i.log"
    fi
done
rm -rf "$logdir"
echo "fuzz: $(( $(date +%s) - start ))s, $([ $failed -eq 0 ] && echo 'no crash' || echo FAILED)"
exit $failed
