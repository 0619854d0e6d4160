#!/usr/bin/env bash
# tests/vm.sh WORKDIR [--stage DIR] [--disk MIB] -- COMMAND [ARG...] — runs COMMAND as root in a
# virtual machine booted under a real systemd, for the tests that need a whole machine: a unit
# started by systemd (tests/boot_systemd.sh) or a block device that fails on demand
# (test_kvstore_spill's spill_eio_readback).
#
# The machine (qemu, emulated: see DEVELOPERS.md "Tests in a virtual machine") runs this
# machine's Debian kernel (/boot/vmlinuz-*, one whose modules have 9p) and, as its root file
# system, this machine's own root, shared read-only over 9p under a tmpfs overlay: the guest runs
# the programs and libraries installed here, sees this repository at the same path, and writes
# nothing here but WORKDIR/out (a second, writable share, /rekv-out in the guest). --stage DIR is
# copied over the guest's root first (e.g. `make install DESTDIR=`); --disk MIB adds a disk
# (/dev/vda): WORKDIR/disk.img, made empty (sparse) when absent, kept — a second boot finds what
# the first wrote. A busybox initramfs made here mounts all that and hands
# over to systemd, which boots into rekv-vm.target: its one-shot service runs COMMAND in this
# directory and writes its output to out/log and its exit status to out/rc, then powers off.
#
# Exit 0: the machine ran and ended by itself — out/rc holds COMMAND's status when it returned
# (a COMMAND that cuts the power, e.g. sysrq's reboot, leaves none); 77: a VM cannot run here (why
# on stderr); anything else: it did not start or end (the console's tail on stderr).
set -u
W=${1:?usage: vm.sh WORKDIR [--stage DIR] [--disk MIB] -- COMMAND [ARG...]}
shift
STAGE= DISK=
while [ $# -gt 0 ]; do
    case $1 in
    --stage) STAGE=$(realpath "$2") || exit 2; shift 2 ;;
    --disk) DISK=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "vm.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "vm.sh: no command" >&2; exit 2; }
REPO=$(pwd)
W=$(realpath "$W") || exit 2
skip() { echo "skip: $*" >&2; exit 77; }
fail() { echo "vm.sh: $*" >&2; exit 1; }

QEMU=$(command -v qemu-system-x86_64) || skip "qemu-system-x86_64 is not installed (package qemu-system-x86)"
BUSYBOX=/bin/busybox
[ -x $BUSYBOX ] || skip "busybox is not installed (package busybox-static)"
ldd $BUSYBOX 2>&1 | grep -q 'not a dynamic' || skip "busybox is not statically linked (package busybox-static)"
command -v cpio >/dev/null || skip "cpio is not installed"
[ -x /lib/systemd/systemd ] || skip "systemd is not installed"
[ "$(uname -m)" = x86_64 ] || skip "not an x86_64 machine"
KVER=
for k in /boot/vmlinuz-*; do
    v=${k#/boot/vmlinuz-}
    if [ -r "$k" ] && modprobe --show-depends -S "$v" 9p >/dev/null 2>&1; then KVER=$v; fi
done
[ -n "$KVER" ] || skip "no kernel in /boot whose modules have 9p (package linux-image-amd64)"

rm -rf "$W/out" "$W/initrd" "$W/units" && mkdir -p "$W/out" "$W/initrd" "$W/units" || exit 2

# --- the command, and the target that runs it (copied into the guest's /etc/systemd/system) ---
{
    printf 'cd %q || exit 2\n' "$REPO"
    printf '%q ' "$@"
    printf '\n'
} >"$W/command.sh"
cat >"$W/units/rekv-vm.target" <<'EOF'
[Unit]
Description=rekv test machine
Requires=rekv-vm.service
After=rekv-vm.service
EOF
cat >"$W/units/rekv-vm.service" <<EOF
[Unit]
Description=rekv test machine: the command, then power off
After=basic.target

[Service]
Type=oneshot
Environment=HOME=/root
ExecStart=/bin/sh -c '/bin/sh $W/command.sh >/rekv-out/log 2>&1; echo \$? >/rekv-out/rc'
ExecStopPost=/bin/systemctl poweroff --no-block
EOF

# --- the initramfs: busybox, the modules for virtio, 9p and overlay, and /init -------------
I=$W/initrd
mkdir -p "$I/bin" "$I/mods" "$I/proc" "$I/sys" "$I/dev" "$I/lower" "$I/rw" "$I/newroot"
cp "$BUSYBOX" "$I/bin/busybox" || exit 2
for a in sh mount umount insmod mkdir cp rm switch_root echo cat poweroff; do
    ln -s busybox "$I/bin/$a"
done
: >"$I/mods/order"
for m in virtio_pci 9pnet_virtio 9p overlay; do
    modprobe --show-depends -S "$KVER" "$m" | awk '$1 == "insmod" {print $2}'
done | awk '!seen[$0]++' | while read -r ko; do
    b=$(basename "$ko")
    case $ko in
    *.ko) cp "$ko" "$I/mods/$b" ;;
    *.ko.xz) xz -dc "$ko" >"$I/mods/${b%.xz}"; b=${b%.xz} ;;
    *.ko.zst) zstd -qdc "$ko" >"$I/mods/${b%.zst}"; b=${b%.zst} ;;
    *) exit 1 ;;
    esac
    echo "$b" >>"$I/mods/order"
done || fail "could not copy the kernel modules"
cat >"$I/init" <<EOF
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in \$(cat /mods/order); do insmod /mods/\$m || echo "insmod \$m failed"; done
fail() { echo "rekv vm initramfs: \$*"; poweroff -f; }
mount -t 9p -o ro,trans=virtio,version=9p2000.L,cache=loose,msize=262144 hostroot /lower ||
    fail "cannot mount the host's root"
mount -t tmpfs -o size=1g,mode=0755 rw /rw && mkdir /rw/upper /rw/work || fail "tmpfs"
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot ||
    fail "cannot mount the overlay"
if [ -n "$STAGE" ]; then cp -a "/lower$STAGE/." /newroot/ || fail "cannot copy the stage"; fi
mkdir -p /newroot/etc/systemd/system && cp "/lower$W/units/"* /newroot/etc/systemd/system/ ||
    fail "cannot copy the units"
# systemd-tmpfiles would empty /tmp at boot (tmp.conf's D line): the guest would no longer see
# the host's files there (a repository or a test's directory under /tmp)
mkdir -p /newroot/etc/tmpfiles.d && ln -sf /dev/null /newroot/etc/tmpfiles.d/tmp.conf
# the host may be a container: its marker would make systemd think so too (and ignore the
# kernel command line)
rm -f /newroot/.dockerenv /newroot/run/.containerenv
mkdir -p /newroot/rekv-out
mount -t 9p -o trans=virtio,version=9p2000.L out /newroot/rekv-out || fail "cannot mount out"
umount /proc /sys
mount --move /dev /newroot/dev 2>/dev/null || umount /dev
exec switch_root /newroot /lib/systemd/systemd --unit=rekv-vm.target
EOF
chmod 0755 "$I/init"
(cd "$I" && find . | cpio -o -H newc --quiet | gzip -1) >"$W/initrd.cpio.gz" ||
    fail "cannot pack the initramfs"

# --- boot --------------------------------------------------------------------------------------
ACCEL=(-accel tcg)
if [ -n "${REKV_VM_KVM:-}" ] && (exec 3<>/dev/kvm) 2>/dev/null; then
    ACCEL=(-accel kvm)
fi
DRIVE=()
if [ -n "$DISK" ]; then
    [ -e "$W/disk.img" ] || truncate -s "${DISK}M" "$W/disk.img" || exit 2
    DRIVE=(-drive "file=$W/disk.img,if=virtio,format=raw")
fi
# a line every 30 s to $REKV_TEST_PROGRESS (tests/run_tests.sh sets it) while the machine runs:
# the test that called this captures its output, and a boot takes minutes
progress() {
    [ -n "${REKV_TEST_PROGRESS:-}" ] || return 0
    printf '   vm: %s\n' "$*" 2>/dev/null >>"$REKV_TEST_PROGRESS" || true
}
progress "booting ($KVER, ${ACCEL[1]}) to run $(basename "${@: -1}")"
timeout "${REKV_VM_TIMEOUT:-540}" "$QEMU" "${ACCEL[@]}" -m 2048 -smp 2 \
    -display none -no-reboot -serial "file:$W/console.log" -monitor none \
    -kernel "/boot/vmlinuz-$KVER" -initrd "$W/initrd.cpio.gz" \
    -append "console=ttyS0 rdinit=/init panic=-1 systemd.show_status=1" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs local,path="$W/out",mount_tag=out,security_model=none,multidevs=remap \
    "${DRIVE[@]}" &
qemu=$!
for ((s = 1; ; s++)); do
    sleep 1
    kill -0 "$qemu" 2>/dev/null || break
    if ((s % 30 == 0)); then
        progress "${s}s: $(tail -n 1 "$W/console.log" 2>/dev/null |
            sed 's/\x1b\[[0-9;]*[A-Za-z]//g' | tr -cd '[:print:]' | cut -c1-90)"
    fi
done
wait "$qemu"
rc=$?
progress "ended after ${s}s (qemu exit $rc)"
if [ $rc -ne 0 ]; then
    tail -n 60 "$W/console.log" >&2
    fail "the machine did not run to its end (qemu exit $rc)"
fi
exit 0
