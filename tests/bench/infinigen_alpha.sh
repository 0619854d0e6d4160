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
OUT=tests/bench
if [ $PLOT_ONLY = 0 ]; then
. "$(dirname "$0")/eval_samples.sh"

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
        # shellcheck disable=SC2086
        sum=$(eval_means --mode infinigen --alpha "$a" $c | cut -d' ' -f1,2)
        row="$row $sum"
        IFS='|'
    done
    unset IFS
    echo "$row" >> "$OUT/infinigen_alpha.dat"
    echo "alpha $a done" >&2
done
echo "# resident $(resident_mean)" >> "$OUT/infinigen_alpha.dat"
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
