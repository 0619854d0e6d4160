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
MODEL=$SHARED/models/stories260K/stories260K.bin
SAMPLES=$SHARED/eval/stories260K.samples.json
OUT=tests/bench/clo_power.dat
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM

python3 - "$SAMPLES" "$tmp" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
with open(sys.argv[2] + "/resident", "w") as r:
    for i, s in enumerate(d["samples"]):
        ids = s["ids"] if isinstance(s["ids"], list) else json.loads(s["ids"])
        json.dump(ids, open("%s/s%d.json" % (sys.argv[2], i), "w"))
        r.write("%s\n" % s["nll"])
PY

# mean NLL, mean fraction of offload's KV bytes, mean hit ratio over the samples of one setting
mean() {
    for s in "$tmp"/s*.json; do
        # shellcheck disable=SC2068
        "$REKV" eval --model "$MODEL" --ids "$s" --backend cpu --json $@ 2>/dev/null
    done | python3 -c '
import json, sys
r = [json.loads(l) for l in sys.stdin if l.strip()]
print("%.4f %.4f %.3f" % (sum(x["nll"] for x in r) / len(r),
                          sum(x["h2d_kv_bytes"] / x["kv_bytes_offload"] for x in r) / len(r),
                          sum(x.get("hit_ratio", 0) for x in r) / len(r)))'
}

{
    python3 -c 'import sys; v=[float(l) for l in open(sys.argv[1])]; print("# resident nll %.4f" % (sum(v)/len(v)))' "$tmp/resident"
    echo "# setting | p | nll | kv bytes / offload's | hit ratio"
    for cap in 0.2 0.1; do
        echo "infinigen --fetch-cap $cap | - | $(mean --mode infinigen --fetch-cap $cap)"
        echo "infinigen --fetch-cap $cap --lookahead 0 --partial-ratio 1 | - | $(mean --mode infinigen --fetch-cap $cap --lookahead 0 --partial-ratio 1)"
        for c in "--lookahead 1" "--lookahead 0 --partial-ratio 1"; do
            for pw in 0.01 0.25 0.5 1 2 3; do
                # shellcheck disable=SC2086
                echo "clo --fetch-cap $cap $c | $pw | $(mean --mode clo --fetch-cap $cap $c --power $pw)"
            done
            echo "clo setting done: $cap $c" >&2
        done
    done
} | tee "$OUT"
