#!/usr/bin/env bash
# tests/bench/soak-vm.sh [N] — issue 41's soak (tests/bench/soak.c) with a spill tier that fails:
# in a virtual machine (tests/vm.sh) the kvstore's spill file lives on ext4 over a device-mapper
# disk whose table becomes `error` at N/2 submissions — every read and write of the spill tier
# fails — and is mended 5 s later (the soak's REKV_SOAK_SPILL_FAIL / _MEND). Everything else is the
# soak's own faults (kill -9 of each daemon, the store SIGSTOPped). Prints the soak's JSON summary;
# exit status the soak's (0: nothing lost, run twice or wrong, no RSS growth of 10%). A benchmark,
# not a test: minutes. Set REKV_VM_KVM=1 where /dev/kvm may be used.
set -euo pipefail
N=${1:-2000}
cd "$(dirname "$0")/../.."
make -s build/tests/bench/soak
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
DEV=/dev/mapper/rekv-soak
TABLE='"0 $(blockdev --getsz /dev/vda) linear /dev/vda 0"'
cat > "$W/in-vm.sh" <<IN
set -eu
modprobe dm_mod
dmsetup create rekv-soak --table $TABLE
mkfs.ext4 -q $DEV
mkdir -p /mnt/spill
mount -o errors=continue $DEV /mnt/spill
export REKV_SOAK_SPILL_DIR=/mnt/spill
export REKV_SOAK_SPILL_FAIL='dmsetup suspend rekv-soak && dmsetup load rekv-soak --table "0 \$(blockdev --getsz $DEV) error" && dmsetup resume rekv-soak'
export REKV_SOAK_SPILL_MEND='dmsetup suspend rekv-soak && dmsetup load rekv-soak --table $TABLE && dmsetup resume rekv-soak'
REKV_BUILD=build build/tests/bench/soak $N > /rekv-out/soak.json
IN
rc=0
REKV_VM_TIMEOUT=${REKV_VM_TIMEOUT:-1800} tests/vm.sh "$W" --disk 256 -- bash "$W/in-vm.sh" || rc=$?
[ "$rc" -eq 0 ] || { echo "soak-vm: the machine did not run (exit $rc)" >&2; exit "$rc"; }
cat "$W/out/soak.json" 2>/dev/null || { tail -30 "$W/out/log" >&2; exit 1; }
exit "$(cat "$W/out/rc")"
