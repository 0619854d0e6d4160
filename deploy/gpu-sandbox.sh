#!/usr/bin/env bash
# Building rekv on a machine that has CUDA but not Debian's -dev packages rekv links (the device
# machine lent to some sessions: nvcc, cuBLAS and a GPU, no liburing/libzmq/protobuf-c/OpenBLAS/Check).
#   deploy/gpu-sandbox.sh fetch    here (Debian, network to the mirror): apt-get download the .debs
#                                  into debs/ (git-ignored); carry debs/ to the device machine
#   deploy/gpu-sandbox.sh build    there: unpack debs/ into debs/root with dpkg -x (never into /) and
#                                  run make with pkg-config, the compiler and the loader pointed at it;
#                                  extra arguments go to make (e.g. `test`)
#   deploy/gpu-sandbox.sh exec CMD...  there, after build: runs CMD with the loader pointed at debs/root
#                                  (a test program, `tests/run_tests.sh DIR/tests/test_*`, ...)
#   deploy/gpu-sandbox.sh gpu-build DIR  there: builds into DIR only what a GPU run needs (the cuda
#                                  object, the programs, test_cuda and its IPC peer test_ipc), the C
#                                  files without -Werror (a newer gcc on the image must not cost a
#                                  session; nvcc keeps its own); a no-op on a warm machine that kept DIR
#   deploy/gpu-sandbox.sh cases DIR [CASE...]  there, after gpu-build: test_cuda one Check case at a
#                                  time (default: kernels runtime pipeline modes, cheapest first), each
#                                  under a timeout that fits what is left of BUDGET_S seconds (default
#                                  540), Check told to give up first so the log keeps what passed; a
#                                  line per case (and its failures) in $OUT/summary.txt, its log in
#                                  $OUT/cuda-CASE.log (OUT: default /tmp/gpu-out)
#   deploy/gpu-sandbox.sh synth DIR  there: writes the benches' OPT-6.7B-shaped fp16 model (~13 GB, in
#                                  $TMPDIR) unless it is there (bench does it too; run it in the
#                                  background of `cases` to save the time)
#   deploy/gpu-sandbox.sh bench DIR  there, after build: synthesises an OPT-6.7B-shaped fp16 model
#                                  (~13 GB, in $TMPDIR) and runs issue 6's measurement with DIR's
#                                  binaries: `rekv bench decode --backend cuda`, batch 64, prompt
#                                  512, gen 32, fp16 KV in host memory, every mode (offload and
#                                  kvpr by pull and by push); JSON on stdout
#   deploy/gpu-sandbox.sh bench-sparse DIR  the same model, issues 12 and 13's table: batch 16,
#                                  prompt 2048, gen 8, resident, offload, kvpr, act, infinigen and
#                                  clo in one run (~8 min); JSON on stdout
#   deploy/gpu-sandbox.sh hf DIR   the same model and shape as bench through HuggingFace
#                                  transformers (deploy/hf_bench.py: its default and its offloaded
#                                  cache, greedy, the same prompts; tokens_crc32c compares the ids
#                                  with rekv's); JSON lines on stdout. The image's python3 has torch
#                                  and transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD/debs/root
arch=$(gcc -dumpmachine)
libs() {
    export LD_LIBRARY_PATH=$root/usr/lib/$arch:$root/lib/$arch:$root/usr/lib/$arch/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
model=${TMPDIR:-/tmp}/opt-6.7b-synth
synth() { # $1: the build's bin/
    [ -f "$model/model.safetensors" ] ||
        "$1/rekv-loader" synth --arch opt --layers 32 --hidden 4096 --heads 32 --ffn 16384 \
            --vocab 50272 --max-pos 4096 --dtype f16 --seed 67 "$model" >&2
}
# test_cuda's cases and the timeouts test_cuda.c gives them (tcase_set_timeout), and the seconds a
# GPU run gives each at most (session 19's estimates: runtime ~3 min, modes the longest)
case_base() { case $1 in pipeline) echo 600 ;; modes) echo 900 ;; *) echo 300 ;; esac; }
case_want() { case $1 in kernels) echo 120 ;; runtime | pipeline) echo 180 ;; *) echo 100000 ;; esac; }
case "${1:-}" in
fetch)
    mkdir -p debs
    # the library -dev packages of deploy/debian-packages.txt, what they depend on, and the runtime
    # libraries those need in turn, less what every machine has (libc, libgcc, libstdc++, zlib, the
    # toolchain): ~20 MB to carry
    base='^(libc6|libc6-dev|libc-dev|libgcc-s1|libstdc\+\+6|zlib1g|libgcc-12-dev|gcc|g\+\+|cpp|pkg-config|pkgconf|mawk|linux-libc-dev|libcrypt1|libcrypt-dev|debconf|libgomp1|libgfortran5|libquadmath0|libzstd1|liblzma5|libselinux1|libpcre2-16-0|libpcre2-32-0|libpcre2-posix3)$'
    deps_of() { apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks \
                --no-replaces --no-enhances "$@" | sed -n 's/^ *|\{0,1\}Depends: //p' | grep -v '^<'; }
    pkgs=$(grep -E -- '-dev$|^check$|^protobuf-c-compiler$' deploy/debian-packages.txt)
    lvl1=$(deps_of $pkgs | sort -u | grep -vE "$base")
    lvl2=$(deps_of $(echo "$lvl1" | grep -v -- '-dev$') | sort -u | grep -vE "$base" | grep -v -- '-dev$')
    deps=$(printf '%s\n' $pkgs $lvl1 $lvl2 | sort -u | grep -vE 'openblas.*(openmp|serial)')
    (cd debs && apt-get download $deps)
    ls debs/*.deb | wc -l
    ;;
build)
    shift
    mkdir -p "$root"
    for d in debs/*.deb; do dpkg -x "$d" "$root"; done
    export PKG_CONFIG_SYSROOT_DIR=$root
    export PKG_CONFIG_PATH=$root/usr/lib/$arch/pkgconfig:$root/usr/share/pkgconfig:$root/usr/lib/pkgconfig
    export CPATH=$root/usr/include:$root/usr/include/$arch
    export LIBRARY_PATH=$root/usr/lib/$arch:$root/lib/$arch
    libs
    export PATH=$root/usr/bin:$PATH
    export PATH=/usr/local/cuda/bin:$PATH
    make "$@"
    ;;
exec)
    shift
    libs
    exec "$@"
    ;;
gpu-build)
    dir=${2:?usage: gpu-sandbox.sh gpu-build BUILD_DIR}
    shift 2
    exec "$0" build BUILD="$dir" -j"$(nproc)" WARN='-Wall -Wno-unused-parameter' \
        "$dir/lib/rekv/librekv_cuda.so" "$dir/bin/rekv" "$dir/bin/rekv-loader" \
        "$dir/bin/rekv-kvstore" "$dir/bin/rekv-gpuworker" "$dir/bin/rekv-coordinator" \
        "$dir/tests/test_cuda" "$dir/tests/test_ipc" "$@"
    ;;
cases)
    dir=${2:?usage: gpu-sandbox.sh cases BUILD_DIR [CASE...]}
    shift 2
    libs
    out=${OUT:-/tmp/gpu-out}
    mkdir -p "$out"
    deadline=$(($(date +%s) + ${BUDGET_S:-540}))
    # the pipeline cases read ../shared's stories260K: a copy in .shared travels with the tree
    [ -e ../shared ] || [ ! -d .shared ] || ln -s "$PWD/.shared" ../shared
    export REKV_BUILD=$dir CK_VERBOSITY=verbose
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
        >>"$out/summary.txt" 2>&1 || true
    for c in ${@:-kernels runtime pipeline modes}; do
        want=$(case_want "$c") left=$((deadline - $(date +%s) - 10))
        lim=$((want < left ? want : left))
        if [ "$lim" -le 30 ]; then
            echo "test_cuda $c: not run, no time left" | tee -a "$out/summary.txt"
            continue
        fi
        t=$(date +%s) rc=0
        CK_RUN_CASE=$c CK_TIMEOUT_MULTIPLIER=$(awk "BEGIN{print ($lim - 5) / $(case_base "$c")}") \
            timeout -k 10 "$lim" "$dir/tests/test_cuda" >"$out/cuda-$c.log" 2>&1 || rc=$?
        echo "test_cuda $c rc=$rc $(($(date +%s) - t))s (limit ${lim}s):" \
            "$(grep -E '^[0-9]+%' "$out/cuda-$c.log" || echo 'no Check summary')" |
            tee -a "$out/summary.txt"
        grep -E ':[EF]:' "$out/cuda-$c.log" | head -5 | tee -a "$out/summary.txt" || true
    done
    ;;
synth)
    libs
    synth "${2:?usage: gpu-sandbox.sh synth BUILD_DIR}/bin"
    ;;
bench | bench-sparse | hf)
    bin=${2:?usage: gpu-sandbox.sh $1 BUILD_DIR}/bin
    libs
    synth "$bin"
    if [ "$1" = hf ]; then
        python3 deploy/hf_bench.py "$model" --batch 64 --prompt-len 512 --gen-len 32 --dtype f16 "${@:3}"
    elif [ "$1" = bench ]; then
        "$bin/rekv" bench decode --model "$model" --backend cuda --batch 64 --prompt-len 512 \
            --gen-len 32 --cache-dtype f16 --json \
            --modes resident,offload,offload+push,kvpr,kvpr+push,act,hybrid "${@:3}"
    else
        "$bin/rekv" bench decode --model "$model" --backend cuda --batch 16 --prompt-len 2048 \
            --gen-len 8 --cache-dtype f16 --json \
            --modes resident,offload,kvpr,act,infinigen,clo "${@:3}"
    fi
    ;;
*)
    sed -n '2,/^set /{/^#/p}' "$0"
    exit 2
    ;;
esac
