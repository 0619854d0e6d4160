#!/bin/sh
# NLL, KV bytes and head-cache hit ratio of `rekv eval --mode clo` against the thresholds' power p
# (CLO Eq. 8: tau from importance^p, so a larger p lowers every threshold but the most important
# head's, which stays eta) on the stories260K samples of ../shared/eval, with infinigen at the same
# fetch cap beside it; written to tests/bench/clo_power.dat (one row per configuration and p: the
# means over the samples). A benchmark, not a test: a few minutes on two
# cores. Run from the repository root after `make`.
#   tests/bench/clo_power.sh [REKV [SHARED]]
set -eu
REKV=${1:-build/bin/rekv}
SHARED=${2:-../shared}
OUT=tests/bench/clo_power.dat
. "$(dirname "$0")/eval_samples.sh"

{
    printf '# resident nll %.4f\n' "$(resident_mean)"
    echo "# setting | p | nll | kv bytes / offload's | hit ratio"
    for cap in 0.2 0.1; do
        echo "infinigen --fetch-cap $cap | - | $(eval_means --mode infinigen --fetch-cap $cap)"
        echo "infinigen --fetch-cap $cap --lookahead 0 --partial-ratio 1 | - | $(eval_means --mode infinigen --fetch-cap $cap --lookahead 0 --partial-ratio 1)"
        for c in "--lookahead 1" "--lookahead 0 --partial-ratio 1"; do
            for pw in 0.01 0.25 0.5 1 2 3; do
                # shellcheck disable=SC2086
                echo "clo --fetch-cap $cap $c | $pw | $(eval_means --mode clo --fetch-cap $cap $c --power $pw)"
            done
            echo "clo setting done: $cap $c" >&2
        done
    done
} | tee "$OUT"
