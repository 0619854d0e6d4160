#!/bin/sh
# NLL and KV bytes of `rekv eval --mode infinigen` against alpha on the stories260K samples of
# ../shared/eval, written to tests/bench/infinigen_alpha.dat and plotted (gnuplot, Debian's
# gnuplot-nox) to tests/bench/infinigen_alpha.png. A benchmark, not a test: about three minutes on
# two cores. Run from the repository root after `make`.
#   tests/bench/infinigen_alpha.sh [REKV [SHARED]]
#   tests/bench/infinigen_alpha.sh --plot      (only redraw the PNG from the .dat)
set -eu
PLOT_ONLY=0
if [ "${1:-}" = --plot ]; then PLOT_ONLY=1; shift; fi
REKV=${1:-build/bin/rekv}
SHARED=${2:-../shared}
MODEL=$SHARED/models/stories260K/stories260K.bin
SAMPLES=$SHARED/eval/stories260K.samples.json
OUT=tests/bench
if [ $PLOT_ONLY = 0 ]; then
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

# one row per alpha: alpha, then per configuration the mean NLL over the samples and the mean
# fraction of offload's KV bytes
configs="--fetch-cap=0.2|--fetch-cap=1|--fetch-cap=1 --lookahead=0|--fetch-cap=1 --select=random|--fetch-cap=1 --lookahead=0 --partial-ratio=1"
printf '# alpha' > "$OUT/infinigen_alpha.dat"
echo "$configs" | tr '|' '\n' | while read -r c; do printf ' | %s: nll bytes' "$c"; done >> "$OUT/infinigen_alpha.dat"
echo >> "$OUT/infinigen_alpha.dat"
for a in 0.25 0.5 1 2 3 4 5 6 8 12 16; do
    row=$a
    IFS='|'
    for c in $configs; do
        unset IFS
        sum=$(for s in "$tmp"/s*.json; do
            # shellcheck disable=SC2086
            "$REKV" eval --model "$MODEL" --ids "$s" --mode infinigen --alpha "$a" $c --json 2>/dev/null
        done | python3 -c '
import json, sys
r = [json.loads(l) for l in sys.stdin if l.strip()]
print("%.4f %.4f" % (sum(x["nll"] for x in r) / len(r),
                     sum(x["h2d_kv_bytes"] / x["kv_bytes_offload"] for x in r) / len(r)))')
        row="$row $sum"
        IFS='|'
    done
    unset IFS
    echo "$row" >> "$OUT/infinigen_alpha.dat"
    echo "alpha $a done" >&2
done
python3 -c 'import sys; v=[float(l) for l in open(sys.argv[1])]; print("# resident %.6f" % (sum(v)/len(v)))' "$tmp/resident" >> "$OUT/infinigen_alpha.dat"
fi
res=$(sed -n 's/^# resident //p' "$OUT/infinigen_alpha.dat")

gnuplot <<GP
set terminal pngcairo size 1100,460 font ",10"
set output "$OUT/infinigen_alpha.png"
set multiplot layout 1,2 title "rekv eval --mode infinigen on stories260K (mean of the 3 ../shared/eval samples)"
set logscale x 2
set xlabel "alpha"
set key top right
set ylabel "NLL (nats/token)"
plot "$OUT/infinigen_alpha.dat" u 1:2 w lp t "speculate, fetch-cap 0.2 (defaults)", \
     "" u 1:4 w lp t "speculate, no cap", \
     "" u 1:6 w lp t "speculate, no cap, lookahead 0", \
     "" u 1:8 w lp t "random, same count", \
     "" u 1:10 w lp t "exact scores (lookahead 0, all columns), no cap", \
     $res w l dt 2 lc rgb "black" t "resident"
set ylabel "KV bytes / offload's"
set key top left
plot "$OUT/infinigen_alpha.dat" u 1:3 w lp t "fetch-cap 0.2", \
     "" u 1:5 w lp t "no cap", \
     "" u 1:7 w lp t "no cap, lookahead 0", \
     "" u 1:9 w lp t "random, same count", \
     "" u 1:11 w lp t "exact scores, no cap"
unset multiplot
GP
echo "wrote $OUT/infinigen_alpha.dat and $OUT/infinigen_alpha.png" >&2
