#!/bin/sh
# bench/decode-layout.sh MODEL [RUNS] — what the cpu GEMM's tile layout gives a decode at batch 1
# (issue 42): `rekv bench forward` at 1 and 2 GEMM threads with the engine's weights tiled (the
# default) and row-major (--row-major, as before the layout), RUNS interleaved runs of each (default
# 5), and their medians: decode and prefill tokens/s, peak resident memory, and the one-row f16
# GEMM's GB/s (tiled, row-major) beside a plain read of the same bytes. Prints one JSON object.
# REKV (default build/bin/rekv) names the program; BATCHES (1), PROMPT_LEN (16) and STEPS (32) the
# runs' shape (BATCHES=1,8: each batch size in each run).
set -eu
[ $# -ge 1 ] || { echo "usage: bench/decode-layout.sh MODEL [RUNS]" >&2; exit 2; }
model=$1
runs=${2:-5}
rekv=${REKV:-build/bin/rekv}
out=$(mktemp -d "${TMPDIR:-/tmp}/decode-layout.XXXXXX")
trap 'rm -rf "$out"' EXIT
i=0
while [ "$i" -lt "$runs" ]; do
    for t in 1 2; do
        for layout in tiled row-major; do
            flag=
            [ "$layout" = row-major ] && flag=--row-major
            # shellcheck disable=SC2086 # flag is empty or one word
            "$rekv" bench forward --model "$model" --batches "${BATCHES:-1}" --prompt-len "${PROMPT_LEN:-16}" \
                --decode-steps "${STEPS:-32}" --threads "$t" $flag --json \
                >"$out/$layout-t$t-$i.json"
        done
    done
    i=$((i + 1))
done
/usr/bin/python3 - "$out" "$runs" <<'PY'
import json, statistics, sys
d, runs = sys.argv[1], int(sys.argv[2])
res = {"runs": runs, "configs": []}
for t in (1, 2):
    for layout in ("tiled", "row-major"):
        js = [json.load(open(f"{d}/{layout}-t{t}-{i}.json")) for i in range(runs)]
        med = lambda f: statistics.median(f(j) for j in js)
        res["configs"].append({
            "threads": t, "weights_layout": layout,
            "batches": [{
                "batch": r["batch"],
                "decode_tokens_per_s": med(lambda j: j["runs"][b]["decode_tokens_per_s"]),
                "prefill_tokens_per_s": med(lambda j: j["runs"][b]["prefill_tokens_per_s"]),
            } for b, r in enumerate(js[0]["runs"])],
            "peak_rss_bytes": med(lambda j: j["peak_rss_bytes"]),
            "gemv_read_gbps": med(lambda j: j["gemv_f16"]["read_gbps"]),
            "gemv_tiled_gbps": med(lambda j: j["gemv_f16"]["tiled_gbps"]),
            "gemv_row_major_gbps": med(lambda j: j["gemv_f16"]["row_major_gbps"]),
        })
print(json.dumps(res, indent=2))
PY
