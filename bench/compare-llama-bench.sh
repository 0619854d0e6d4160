#!/bin/sh
# bench/compare-llama-bench.sh LLAMA_BENCH GGUF MODEL_DIR [RUNS] — rekv's cpu backend beside
# llama.cpp on the same weights, side by side in one run (issue 42 item 4): llama-bench (a binary
# the user built; nothing of llama.cpp is vendored or downloaded here) on GGUF, and `rekv bench
# forward` on MODEL_DIR (the HF directory GGUF was converted from), at batch 1: a prefill of
# PROMPT_LEN (512) tokens and a decode of STEPS (128) tokens, at each of THREADS (1,2) threads;
# RUNS (5) runs of each, interleaved (rekv, llama.cpp, rekv, ...), and their medians, with each
# program's peak resident memory (rekv's own report; llama-bench's by /usr/bin/time). Prints one
# JSON object. REKV (default build/bin/rekv) names rekv.
set -eu
[ $# -ge 3 ] || {
    echo "usage: bench/compare-llama-bench.sh LLAMA_BENCH GGUF MODEL_DIR [RUNS]" >&2
    exit 2
}
lb=$1 gguf=$2 model=$3 runs=${4:-5}
rekv=${REKV:-build/bin/rekv}
pl=${PROMPT_LEN:-512} steps=${STEPS:-128} threads=${THREADS:-1,2}
[ -x "$lb" ] || { echo "compare-llama-bench: $lb: not an executable llama-bench" >&2; exit 2; }
[ -f "$gguf" ] || { echo "compare-llama-bench: $gguf: no such GGUF file" >&2; exit 2; }
[ -f "$model/config.json" ] || { echo "compare-llama-bench: $model: no config.json" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "compare-llama-bench: needs /usr/bin/time (Debian: time)" >&2; exit 2; }
out=$(mktemp -d "${TMPDIR:-/tmp}/compare-llama.XXXXXX")
trap 'rm -rf "$out"' EXIT
i=0
while [ "$i" -lt "$runs" ]; do
    for t in $(echo "$threads" | tr , ' '); do
        "$rekv" bench forward --model "$model" --batches 1 --prompt-len "$pl" \
            --decode-steps "$steps" --threads "$t" --json >"$out/rekv-t$t-$i.json"
        # one repetition per run: the runs interleave with rekv's instead
        /usr/bin/time -f %M -o "$out/llama-t$t-$i.rss" "$lb" -m "$gguf" -p "$pl" -n "$steps" \
            -t "$t" -r 1 -o json >"$out/llama-t$t-$i.json"
    done
    i=$((i + 1))
done
/usr/bin/python3 - "$out" "$runs" "$threads" <<'PY'
import json, statistics, sys
d, runs, threads = sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")]
med = statistics.median
res = {"runs": runs, "threads": []}
for t in threads:
    rk = [json.load(open(f"{d}/rekv-t{t}-{i}.json")) for i in range(runs)]
    ll = [json.load(open(f"{d}/llama-t{t}-{i}.json")) for i in range(runs)]
    rss = [int(open(f"{d}/llama-t{t}-{i}.rss").read().split()[-1]) * 1024 for i in range(runs)]
    # llama-bench: one object per test, pp (n_gen 0) and tg (n_prompt 0), avg_ts in tokens/s
    lpp = med(next(x["avg_ts"] for x in r if x["n_gen"] == 0) for r in ll)
    ltg = med(next(x["avg_ts"] for x in r if x["n_prompt"] == 0) for r in ll)
    rpp = med(r["runs"][0]["prefill_tokens_per_s"] for r in rk)
    rtg = med(r["runs"][0]["decode_tokens_per_s"] for r in rk)
    res["threads"].append({
        "threads": t,
        "prefill_tokens": rk[0]["prompt_len"], "decode_tokens": rk[0]["decode_steps"],
        "rekv": {"prefill_tokens_per_s": rpp, "decode_tokens_per_s": rtg,
                 "peak_rss_bytes": med(r["peak_rss_bytes"] for r in rk)},
        "llama_cpp": {"prefill_tokens_per_s": lpp, "decode_tokens_per_s": ltg,
                      "peak_rss_bytes": med(rss)},
        "prefill_ratio": rpp / lpp, "decode_ratio": rtg / ltg,
    })
print(json.dumps(res, indent=2))
PY
