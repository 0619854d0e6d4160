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
bench | bench-sparse | hf)
    bin=${2:?usage: gpu-sandbox.sh $1 BUILD_DIR}/bin
    libs
    model=${TMPDIR:-/tmp}/opt-6.7b-synth
    [ -f "$model/model.safetensors" ] ||
        "$bin/rekv-loader" synth --arch opt --layers 32 --hidden 4096 --heads 32 --ffn 16384 \
            --vocab 50272 --max-pos 4096 --dtype f16 --seed 67 "$model" >&2
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
