#!/usr/bin/env bash
# tests/boot_systemd.sh WORKDIR [BUILD] — boots a virtual machine under a real systemd and
# deploys rekv in it as README's "Deployment" says, for tests/test_deploy.c (systemd_boot).
#
# The machine (qemu; KVM where /dev/kvm opens, else emulation) runs this machine's Debian kernel
# (/boot/vmlinuz-*, one whose modules have 9p) and, as its root file system, this machine's own
# root, shared read-only over 9p under a tmpfs overlay: the guest writes nothing here but WORKDIR/
# out (a second, writable share). A busybox initramfs made here mounts them and hands over to
# systemd, which boots into rekv-boot.target: the one-shot rekv-boot-check.service then runs the
# operator's steps — systemd-sysusers, the environment file from its example, `systemctl enable
# --now` of the three units — submits a job with `rekv submit`, waits past the units' watchdog,
# records what systemd and the processes say into out/, stops the units and powers off.
#
# In WORKDIR: stage/ (`make install DESTDIR=`, default PREFIX, plus a synthetic model at
# /var/lib/rekv/models/model and the two boot units), initrd.cpio.gz, console.log, out/. The
# test reads out/ and compares the job's tokens with `rekv generate --local`.
# Exit 0: the guest ran the check to its end (out/done); 77: cannot run here (why on stderr);
# anything else: a failure (console.log's tail on stderr).
set -u
W=${1:?usage: boot_systemd.sh WORKDIR [BUILD]}
BUILD=${2:-build}
cd "$(dirname "$0")/.." || exit 2
W=$(realpath "$W") || exit 2
skip() { echo "skip: $*" >&2; exit 77; }
fail() { echo "boot_systemd: $*" >&2; exit 1; }

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

rm -rf "$W/stage" "$W/out" "$W/initrd" && mkdir -p "$W/stage" "$W/out" "$W/initrd" || exit 2

# --- the guest's additions: rekv installed as an operator does, a model, the check ----------
env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s install BUILD="$BUILD" DESTDIR="$W/stage" ||
    fail "make install failed"
M=$W/stage/var/lib/rekv/models/model
mkdir -p "$(dirname "$M")" || exit 2
"$BUILD/bin/rekv-loader" synth --arch llama --layers 4 --hidden 64 --heads 4 --kv-heads 2 \
    --ffn 128 --vocab 256 --max-pos 256 --dtype f32 --seed 3 "$M" >/dev/null ||
    fail "rekv-loader synth failed"
chmod -R a+rX "$W/stage/var/lib/rekv"
mkdir -p "$W/stage/etc/systemd/system" "$W/stage/usr/local/lib/rekv-boot"
cat >"$W/stage/etc/systemd/system/rekv-boot.target" <<'EOF'
[Unit]
Description=rekv boot test
Requires=rekv-boot-check.service
After=rekv-boot-check.service
EOF
cat >"$W/stage/etc/systemd/system/rekv-boot-check.service" <<'EOF'
[Unit]
Description=rekv boot test: deploy, submit, record, power off
After=basic.target

[Service]
Type=oneshot
ExecStart=/bin/sh /usr/local/lib/rekv-boot/check.sh
ExecStopPost=/bin/systemctl poweroff --no-block
StandardOutput=journal+console
EOF
cat >"$W/stage/usr/local/lib/rekv-boot/check.sh" <<'EOF'
#!/bin/sh
# Runs in the guest as root. Everything it learns goes to /rekv-out (the host's WORKDIR/out).
O=/rekv-out
exec >>$O/check.log 2>&1
set -x
units="rekv-kvstore rekv-coordinator rekv-gpuworker"
# README's deployment steps (make install was done into the image)
systemd-sysusers || echo "sysusers failed" >>$O/errors
cp /etc/rekv/rekv.env.example /etc/rekv/rekv.env
sed -i -e 's/^REKV_HOST_BYTES=.*/REKV_HOST_BYTES=128K/' \
       -e 's/^REKV_CACHE_DTYPE=.*/REKV_CACHE_DTYPE=f32/' \
       -e 's/^REKV_MAX_BATCH=.*/REKV_MAX_BATCH=4/' -e 's/^REKV_MODE=.*/REKV_MODE=offload/' \
       /etc/rekv/rekv.env
systemctl daemon-reload
systemctl enable --now $units; echo $? >$O/enable.rc
i=0
until rekv status --min-workers 1 >$O/status.txt 2>&1; do
    i=$((i + 1)); [ $i -ge 60 ] && break; sleep 1
done
echo $i >$O/status.waited
# a short job, and a long one whose KV is more than the 128 KiB arena: the store spills
timeout 120 rekv submit --prompt-ids 1,7,42,9 --max-new-tokens 8 --ignore-eos --json \
    >$O/job1.json 2>$O/job1.err; echo $? >$O/job1.rc
timeout 120 rekv submit --prompt-ids $(seq -s, 1 200) --max-new-tokens 8 --ignore-eos --json \
    >$O/job2.json 2>$O/job2.err; echo $? >$O/job2.rc
curl -sS http://127.0.0.1:9465/metrics >$O/kvstore.metrics 2>&1
# past the units' WatchdogSec (10 s): a daemon that does not ping is restarted by now
sleep 12
for u in $units; do
    systemctl show -p ActiveState -p SubState -p NRestarts -p Result -p MainPID $u >$O/$u.show
    pid=$(systemctl show -p MainPID --value $u)
    [ "$pid" -gt 0 ] && stat -c %U /proc/$pid >$O/$u.user
done
for u in $units; do systemd-analyze security --no-pager $u >$O/$u.security 2>&1; done
ls -ld /run/rekv /var/lib/rekv/spill /var/lib/rekv/journal >$O/dirs 2>&1
ls -A /dev/shm >$O/shm.before
systemctl stop $units
for u in $units; do systemctl show -p ActiveState -p Result $u >$O/$u.stopped; done
ls -A /dev/shm >$O/shm.after
journalctl --no-pager -o short-monotonic -u 'rekv-*' >$O/journal.txt 2>&1
echo ok >$O/done
EOF

# --- the initramfs: busybox, the modules for virtio, 9p and overlay, and /init -------------
I=$W/initrd
mkdir -p "$I/bin" "$I/mods" "$I/proc" "$I/sys" "$I/dev" "$I/lower" "$I/rw" "$I/newroot" "$I/out"
cp "$BUSYBOX" "$I/bin/busybox" || exit 2
for a in sh mount insmod mkdir cp switch_root echo cat poweroff sleep; do ln -s busybox "$I/bin/$a"; done
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
fail() { echo "rekv-boot initramfs: \$*"; poweroff -f; }
mount -t 9p -o ro,trans=virtio,version=9p2000.L,cache=loose,msize=262144 hostroot /lower ||
    fail "cannot mount the host's root"
mount -t tmpfs -o size=1g,mode=0755 rw /rw && mkdir /rw/upper /rw/work || fail "tmpfs"
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot ||
    fail "cannot mount the overlay"
cp -a "/lower$W/stage/." /newroot/ || fail "cannot copy the stage"
# the host may be a container: its marker would make systemd think so too (and ignore the
# kernel command line)
rm -f /newroot/.dockerenv /newroot/run/.containerenv
mkdir -p /newroot/rekv-out
mount -t 9p -o trans=virtio,version=9p2000.L out /newroot/rekv-out || fail "cannot mount out"
umount /proc /sys
mount --move /dev /newroot/dev 2>/dev/null || umount /dev
exec switch_root /newroot /lib/systemd/systemd --unit=rekv-boot.target
EOF
chmod 0755 "$I/init"
(cd "$I" && find . | cpio -o -H newc --quiet | gzip -1) >"$W/initrd.cpio.gz" ||
    fail "cannot pack the initramfs"

# --- boot --------------------------------------------------------------------------------------
ACCEL=(-accel tcg)
if [ -n "${REKV_BOOT_KVM:-}" ] && (exec 3<>/dev/kvm) 2>/dev/null; then
    ACCEL=(-accel kvm)
fi
timeout "${REKV_BOOT_TIMEOUT:-540}" "$QEMU" "${ACCEL[@]}" -m 2048 -smp 2 \
    -display none -no-reboot -serial "file:$W/console.log" -monitor none \
    -kernel "/boot/vmlinuz-$KVER" -initrd "$W/initrd.cpio.gz" \
    -append "console=ttyS0 rdinit=/init panic=-1 systemd.show_status=1" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs local,path="$W/out",mount_tag=out,security_model=none,multidevs=remap
rc=$?
if [ ! -e "$W/out/done" ]; then
    tail -n 60 "$W/console.log" >&2
    [ -e "$W/out/check.log" ] && tail -n 40 "$W/out/check.log" >&2
    fail "the guest did not finish its check (qemu exit $rc)"
fi
exit 0
