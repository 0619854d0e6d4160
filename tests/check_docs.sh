#!/usr/bin/env bash
# tests/check_docs.sh [FILE.md...] — runs the shell blocks of the documentation (default: README.md,
# docs/*.md, DEVELOPERS.md and docs/design/*.md), so that a documented command that breaks fails `make test`.
#
# A fenced block whose info string is exactly `sh` is RUN. A block `sh skip:REASON` is only
# syntax-checked (`bash -n`), REASON one of:
#   gpu   needs a GPU
#   model needs a model that is not in ../shared (a download, or a real-size synthetic model)
#   root  needs root, systemd, apt or docker
#   self  is `make test` itself
#   slow  a benchmark: minutes to hours on a cpu (docs/benchmarks.md)
# Any other info string (text, console, json, ...) is not shell and is left alone; `bash`, `shell`
# and a malformed `sh ...` are errors, so that no shell block escapes the check by its fence.
# Every relative link, [text](path), must name a file or directory that exists.
#
# How a block runs: from the repository root, as `bash -euo pipefail BLOCK`, with the programs by
# the path the docs write (build/bin/...: build first), the test models at ../shared, and a scratch
# directory per document: TMPDIR, XDG_RUNTIME_DIR (so a `rekv run` of the docs uses private sockets)
# and XDG_CACHE_HOME (profiles, skews) point into it, fresh for each document and shared by its
# blocks in order (a later block may use what an earlier one made, as a reader would). Docs write
# their temporary paths as "${TMPDIR:-/tmp}/NAME". Each block runs in a process group of its own,
# under a timeout (CHECK_DOCS_TIMEOUT seconds, default 120); when it ends, whatever it left running
# (`rekv run ... &`) is sent SIGTERM, then SIGKILL. Prints a line per block (FILE:LINE ok, skip or
# FAILED, with the block's output on failure); exits 1 when any block failed.
#
# --self-test: plants a failing block, a skipped block with bad syntax, a bad fence, a block that
# leaves a process running and one that runs past its timeout, and checks that each is caught.
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
TIMEOUT=${CHECK_DOCS_TIMEOUT:-120}
REASONS="gpu model root self slow"

self_test() {
    local d rc out pid
    d=$(mktemp -d -t rekv-check-docs-self.XXXXXX) || return 2
    export CHECK_DOCS_SELFTEST_PID=$d/pid
    cat >"$d/doc.md" <<'EOF'
# planted

```sh
echo fine
```

```sh
echo "this block fails"; false
```

```sh skip:model
if then fi
```

```bash
echo a shell block under another fence
```

```sh skip:nonsense
echo an unknown reason
```

```sh
sleep 1000 & echo $! >"$CHECK_DOCS_SELFTEST_PID"
```

```text
this is not shell: ( unbalanced
```

```sh
sleep 30
```

[a link that goes nowhere](no-such-file.md) and [one that does](doc.md)
EOF
    out=$(CHECK_DOCS_TIMEOUT=2 "$0" "$d/doc.md" 2>&1)
    rc=$?
    local fail=0
    expect() { grep -qF -- "$1" <<<"$out" || { echo "check_docs self-test: no '$1' in:"; echo "$out"; fail=1; }; }
    [ $rc -ne 0 ] || { echo "check_docs self-test: exit 0 despite failing blocks"; fail=1; }
    expect "$d/doc.md:3 ok"
    expect "$d/doc.md:7 FAILED"
    expect "this block fails"
    expect "$d/doc.md:11 FAILED"
    expect "$d/doc.md:15 FAILED"
    expect "$d/doc.md:19 FAILED"
    expect "$d/doc.md:23 ok"
    expect "$d/doc.md:31 FAILED"
    expect "timed out"
    expect "$d/doc.md:35 FAILED: link no-such-file.md"
    if grep -qF "link doc.md" <<<"$out"; then echo "check_docs self-test: a good link failed"; fail=1; fi
    if grep -qF "doc.md:27" <<<"$out"; then echo "check_docs self-test: a text block was checked"; fail=1; fi
    pid=$(cat "$d/pid" 2>/dev/null)
    if [ -z "$pid" ]; then
        echo "check_docs self-test: the background block did not run"; fail=1
    elif kill -0 "$pid" 2>/dev/null; then
        echo "check_docs self-test: a block's background process ($pid) outlived it"; kill "$pid"; fail=1
    fi
    rm -rf "$d"
    [ $fail -eq 0 ] && echo "check_docs self-test: ok"
    return $fail
}

# Prints "LINE<TAB>INFO" for each fence opening at the start of a line in $1, and writes each
# block's body to $2/N.sh (N counting from 1).
extract() {
    awk -v dir="$2" '
        !inb && /^```/ { inb = 1; n++; info = substr($0, 4); sub(/[ \t]+$/, "", info);
                         printf "%d\t%s\n", NR, info; f = dir "/" n ".sh"; printf "" > f; next }
        inb && /^```[ \t]*$/ { inb = 0; close(f); next }
        inb { print >> f }
        END { if (inb) printf "%d\tUNCLOSED\n", NR }
    ' "$1"
}

# Prints "LINE:TARGET" for each relative link [text](TARGET) in $1 outside fenced blocks.
links() {
    awk '/^```/ { inb = !inb; next }
         !inb { s = $0
                while (match(s, /\]\([^)]+\)/)) {
                    t = substr(s, RSTART + 2, RLENGTH - 3); s = substr(s, RSTART + RLENGTH)
                    if (t !~ /^(https?:|mailto:|#)/) print NR ":" t } }' "$1"
}

# Stops what is left of the process group $1: SIGTERM, up to 5 s for it to go, then SIGKILL.
reap() {
    kill -TERM -- "-$1" 2>/dev/null || return 0
    for _ in $(seq 50); do
        kill -0 -- "-$1" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -KILL -- "-$1" 2>/dev/null
}

run_block() { # FILE BLOCK SCRATCH OUT: runs one block; returns its status (124: timed out)
    local pid rc
    (
        export TMPDIR=$3/tmp XDG_RUNTIME_DIR=$3/run XDG_CACHE_HOME=$3/cache
        exec setsid timeout -k 5 "$TIMEOUT" bash -euo pipefail "$2"
    ) </dev/null >"$4" 2>&1 &
    pid=$!
    wait $pid
    rc=$?
    reap "$pid"
    return $rc
}

check_file() { # FILE: checks its blocks; returns the number that failed
    local f=$1 work scratch n=0 bad=0 line info reason rc start took out
    work=$(mktemp -d -t rekv-check-docs.XXXXXX) || return 1
    scratch=$work/scratch
    mkdir -p "$scratch/tmp" "$scratch/run" "$scratch/cache" && chmod 0700 "$scratch/run"
    while IFS=$'\t' read -r line info; do
        n=$((n + 1))
        local blk=$work/$n.sh where="$f:$line"
        case $info in
        sh)
            start=${EPOCHREALTIME/./}
            run_block "$f" "$blk" "$scratch" "$work/$n.out"
            rc=$?
            took=$(((${EPOCHREALTIME/./} - start) / 100000))
            took=$((took / 10)).$((took % 10))
            if [ $rc -eq 0 ]; then
                printf '   %s ok (%ss)\n' "$where" "$took"
            else
                [ $rc -eq 124 ] && out="timed out after ${TIMEOUT}s" || out="exit $rc"
                printf '   %s FAILED (%s, %ss):\n' "$where" "$out" "$took"
                sed 's/^/      | /' "$blk"
                echo "      output:"
                tail -n 40 "$work/$n.out" | sed 's/^/      > /'
                bad=$((bad + 1))
            fi
            ;;
        "sh skip:"*)
            reason=${info#sh skip:}
            if [ -z "$reason" ] || [[ $reason == *" "* ]] || ! grep -qw -- "$reason" <<<"$REASONS"; then
                printf '   %s FAILED: skip reason "%s" is not one of: %s\n' "$where" "$reason" "$REASONS"
                bad=$((bad + 1))
            elif ! out=$(bash -n "$blk" 2>&1); then
                printf '   %s FAILED (skip:%s, syntax):\n%s\n' "$where" "$reason" "$(sed 's/^/      > /' <<<"$out")"
                bad=$((bad + 1))
            else
                printf '   %s skip:%s (syntax ok)\n' "$where" "$reason"
            fi
            ;;
        sh* | bash* | shell* | zsh*)
            printf '   %s FAILED: fence "%s": a shell block is `sh` (run) or `sh skip:REASON`\n' "$where" "$info"
            bad=$((bad + 1))
            ;;
        UNCLOSED)
            printf '   %s FAILED: a fence is not closed\n' "$where"
            bad=$((bad + 1))
            ;;
        esac
    done < <(extract "$f" "$work")
    while IFS=: read -r line target; do
        [ -e "$(dirname "$f")/${target%%#*}" ] && continue
        printf '   %s:%s FAILED: link %s: no such file\n' "$f" "$line" "$target"
        bad=$((bad + 1))
    done < <(links "$f")
    rm -rf "$work"
    return $bad
}

if [ "${1:-}" = --self-test ]; then
    self_test
    exit $?
fi
if [ $# -eq 0 ] && [ ! -x build/bin/rekv ]; then
    echo "check_docs: build/bin/rekv is missing: build first (make)" >&2
    exit 2
fi
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(README.md docs/*.md DEVELOPERS.md docs/design/*.md)
total=0
t0=$(date +%s)
for f in "${files[@]}"; do
    printf '== %s\n' "$f"
    check_file "$f"
    total=$((total + $?))
done
took=$(($(date +%s) - t0))
if [ $total -gt 0 ]; then
    echo "check_docs: $total block(s) FAILED (${took}s)"
    exit 1
fi
echo "check_docs: every block passed (${took}s)"
