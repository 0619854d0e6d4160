# eval_samples.sh — sourced by the stories260K eval benchmarks (infinigen_alpha.sh, clo_power.sh)
# after they set REKV and SHARED: sets MODEL, writes each ../shared/eval sample's ids to
# $tmp/sN.json and the samples' reference NLLs to $tmp/resident ($tmp is removed on exit), and
# defines
#   eval_means ARGS...   `rekv eval ARGS` on every sample: the mean NLL, the mean fraction of
#                        offload's KV bytes and the mean head-cache hit ratio (0 where none)
#   resident_mean        the mean reference NLL
MODEL=$SHARED/models/stories260K/stories260K.bin
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM

python3 - "$SHARED/eval/stories260K.samples.json" "$tmp" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
with open(sys.argv[2] + "/resident", "w") as r:
    for i, s in enumerate(d["samples"]):
        ids = s["ids"] if isinstance(s["ids"], list) else json.loads(s["ids"])
        json.dump(ids, open("%s/s%d.json" % (sys.argv[2], i), "w"))
        r.write("%s\n" % s["nll"])
PY

eval_means() {
    for s in "$tmp"/s*.json; do
        "$REKV" eval --model "$MODEL" --ids "$s" --backend cpu --json "$@" 2>/dev/null
    done | python3 -c '
import json, sys
r = [json.loads(l) for l in sys.stdin if l.strip()]
print("%.4f %.4f %.3f" % (sum(x["nll"] for x in r) / len(r),
                          sum(x["h2d_kv_bytes"] / x["kv_bytes_offload"] for x in r) / len(r),
                          sum(x.get("hit_ratio", 0) for x in r) / len(r)))'
}

resident_mean() {
    python3 -c 'import sys; v=[float(l) for l in open(sys.argv[1])]; print("%.6f" % (sum(v)/len(v)))' "$tmp/resident"
}
