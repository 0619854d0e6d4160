#!/usr/bin/env bash
# tests/bench/soak-vm.sh [N] — issue 41's soak (tests/bench/soak.c) with a spill tier that fails:
# in a virtual machine (tests/vm.sh) the kvstore's spill file lives on ext4 over a device-mapper
# disk whose table becomes `error` at N/2 submissions — every read and write of the spill tier
# fails — and is mended 5 s later (the soak's REKV_SOAK_SPILL_FAIL / _MEND). Everything else is the
# soak's own faults (kill -9 of each daemon, the store SIGSTOPped). Prints the soak's JSON summary;
# exit status the soak's (0: nothing lost, run twice or wrong, no RSS growth of 10%). A benchmark,
# not a test: minutes.
set -euo pipefail
N=${1:-2000}
cd "$(dirname "$0")/../.."
make -s build/tests/bench/soak >/dev/null
W=$(mktemp -d)
trap '[ "${keep:-0}" = 1 ] || rm -rf "$W"' EXIT
cat > "$W/in-vm.sh" <<'IN'
set -eu
N=$1
DEV=/dev/mapper/rekv-soak
modprobe virtio_blk 2>/dev/null || true
for _ in $(seq 100); do [ -b /dev/vda ] && break; sleep 0.1; done
SIZE=$(blockdev --getsz /dev/vda)
modprobe dm_mod
dmsetup create rekv-soak --table "0 $SIZE linear /dev/vda 0"
mkfs.ext4 -q $DEV
mkdir -p /mnt/spill
mount -o errors=continue $DEV /mnt/spill
export REKV_SOAK_SPILL_DIR=/mnt/spill
export REKV_SOAK_SPILL_FAIL="dmsetup suspend --nolockfs --noflush rekv-soak && dmsetup load rekv-soak --table '0 $SIZE error' && dmsetup resume rekv-soak"
export REKV_SOAK_SPILL_MEND="dmsetup suspend --nolockfs --noflush rekv-soak && dmsetup load rekv-soak --table '0 $SIZE linear /dev/vda 0' && dmsetup resume rekv-soak"
rc=0
REKV_BUILD=build build/tests/bench/soak "$N" > /rekv-out/soak.json || rc=$?
if [ "$rc" -ne 0 ]; then # the daemons' logs and the kernel's (ext4's view of the failing disk)
    cp /tmp/rekv-soak.*/*.log /rekv-out/ 2>/dev/null || true
    dmesg > /rekv-out/dmesg.log 2>/dev/null || true
fi
# ext4 may abort its journal on the error table (then every later spill write fails, mended or
# not) or ride it out, depending on whether a journal commit fell in the 5 s: say which
if dmesg 2>/dev/null | grep "Remounting filesystem read-only" >/dev/null; then
    echo "soak-vm: ext4 aborted its journal: the spill file system stayed read-only" > /rekv-out/ext4
else
    echo "soak-vm: ext4 rode the failure out: the spill file system came back" > /rekv-out/ext4
fi
exit "$rc"
IN
rc=0
REKV_VM_TIMEOUT=${REKV_VM_TIMEOUT:-1800} tests/vm.sh "$W" --disk 256 -- bash "$W/in-vm.sh" "$N" || rc=$?
[ "$rc" -eq 0 ] || { echo "soak-vm: the machine did not run (exit $rc)" >&2; exit "$rc"; }
rc=$(cat "$W/out/rc" 2>/dev/null || echo 1)
if [ "$rc" -ne 0 ]; then
    keep=1
    tail -40 "$W/out/log" >&2
    echo "soak-vm: the daemons' logs are kept in $W/out" >&2
fi
cat "$W/out/ext4" >&2 2>/dev/null || true
cat "$W/out/soak.json" 2>/dev/null
exit "$rc"
