#!/usr/bin/env bash
# check_rooms.sh — keeps the house as drawn (DEVELOPERS.md "Rooms"): a folder is a room, an
# #include "ROOM/..." an arrow, and every arrow must go to a room the file's own room may use.
# Prints each crossing (file:line, the include, the rule) and fails when there is one. A room's
# private headers (*_internal.h) are its own, with the exceptions listed in PRIVATE_OK.
#
#   tests/check_rooms.sh [ROOT]      check the sources under ROOT (default: the repository)
#   tests/check_rooms.sh --self-test plant forbidden includes in a scratch tree; expect failure
set -u

# Prints one line per crossing for the sources under $1; fails when there is one.
check_tree() {
    local root=$1
    (
        cd "$root" || exit 2
        find . \( -path ./build -o -path './build-*' -o -path ./debs -o -path ./.git \) -prune -o \
            -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' \) -print0 |
            sort -z | xargs -0 -r grep -HnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' |
            awk '
            # the room of a path: the longest folder prefix that is a room
            function room(p) {
                sub(/^\.\//, "", p)
                if (p ~ /^coordinator\/cli\//) return "cli"
                if (p ~ /^gpuworker\/device\//) return "device"
                if (p ~ /^(common|proto|loader|kvstore|gpuworker|coordinator|tests)\//) {
                    sub(/\/.*/, "", p)
                    return p
                }
                return ""
            }
            BEGIN {
                # what each room may use besides itself; tests may use anything
                may["common"] = ""
                may["loader"] = "common"
                may["device"] = "common"
                may["kvstore"] = "common loader proto device"
                may["gpuworker"] = "common loader proto device kvstore"
                may["coordinator"] = "common loader proto"
                may["cli"] = "common loader proto device kvstore gpuworker coordinator"
                # private headers (*_internal.h) another room may include
                private_ok["gpuworker gpuworker/device/cuda_internal.h"] = 1
                bad = 0
            }
            {
                split($0, a, ":")
                file = a[1]; line = a[2]
                inc = $0
                sub(/^[^"]*"/, "", inc); sub(/".*/, "", inc)
                from = room(file); to = room(inc)
                if (from == "" || from == "tests" || to == "" || to == from) next
                sub(/^\.\//, "", file)
                if (index(" " may[from] " ", " " to " ") == 0) {
                    printf "%s:%s: includes \"%s\": the %s room may not use the %s room (it may use: %s)\n", \
                        file, line, inc, from, to, may[from] == "" ? "nothing" : may[from]
                    bad = 1
                } else if (inc ~ /_internal\.h$/ && !((from " " inc) in private_ok)) {
                    printf "%s:%s: includes \"%s\", a private header of the %s room\n", file, line, inc, to
                    bad = 1
                }
            }
            END { exit bad }'
    )
}

self_test() {
    local t rc=0 out
    t=$(mktemp -d) || return 2
    mkdir -p "$t/gpuworker/device" "$t/kvstore" "$t/coordinator/cli" "$t/common"
    printf '#include "common/err.h"\n' >"$t/gpuworker/device/ok.c"
    printf '#include "gpuworker/device/backend.h"\n#include "common/err.h"\n' >"$t/kvstore/ok.c"
    printf '#include "gpuworker/pipeline.h"\n#include "kvstore/kvstore.h"\n' >"$t/coordinator/cli/ok.c"
    if ! out=$(check_tree "$t"); then
        echo "check_rooms self-test: allowed includes were refused: $out"
        rc=1
    fi
    # each forbidden arrow alone must fail the check
    local cases=(
        'gpuworker/w.c|#include "coordinator/planner.h"'
        'kvstore/s.c|#include "gpuworker/pipeline.h"'
        'gpuworker/device/d.c|#include "gpuworker/kernels.h"'
        'coordinator/c.c|#  include "gpuworker/pipeline.h"'
        'coordinator/c.c|#include "kvstore/kvstore.h"'
        'common/x.h|#include "loader/loader.h"'
        'gpuworker/p.c|#include "kvstore/kv_internal.h"'
    )
    local c file text
    for c in "${cases[@]}"; do
        file=${c%%|*}
        text=${c#*|}
        mkdir -p "$t/$(dirname "$file")"
        printf '%s\n' "$text" >"$t/$file"
        if check_tree "$t" >/dev/null; then
            echo "check_rooms self-test: $file with '$text' passed the check"
            rc=1
        fi
        rm -f "$t/$file"
    done
    rm -rf "$t"
    [ $rc -eq 0 ] && echo "check_rooms self-test: ${#cases[@]} forbidden arrows caught"
    return $rc
}

cd "$(dirname "$0")/.." || exit 2
if [ "${1:-}" = --self-test ]; then
    self_test
    exit $?
fi
if check_tree "${1:-.}"; then
    echo "check_rooms: every include goes where its room may"
else
    echo "check_rooms: includes cross the rooms' arrows (DEVELOPERS.md \"Rooms\")"
    exit 1
fi
