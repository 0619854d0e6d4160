#!/usr/bin/env bash
# tests/boot_systemd.sh WORKDIR [BUILD] — deploys rekv under a real systemd as README's
# "Deployment" says, for tests/test_deploy.c (systemd_boot), in a virtual machine (tests/vm.sh).
#
# WORKDIR/stage is what the guest gets over its root: `make install DESTDIR=` (default PREFIX)
# and a synthetic model at /var/lib/rekv/models/model. In the guest, check.sh runs the operator's
# steps — systemd-sysusers, the environment file from its example, `systemctl enable --now` of
# the three units — submits two jobs with `rekv submit` (one spilling past a 128 KiB arena),
# waits past the units' watchdog, records what systemd, the processes and the store's metrics
# say into WORKDIR/out, stops the units and writes out/done. The test reads out/ and compares the
# jobs' tokens with `rekv generate --local`.
# Exit 0: the check ran to its end; 77: a VM cannot run here (why on stderr); else a failure.
set -u
W=${1:?usage: boot_systemd.sh WORKDIR [BUILD]}
BUILD=${2:-build}
cd "$(dirname "$0")/.." || exit 2
W=$(realpath "$W") || exit 2
fail() { echo "boot_systemd: $*" >&2; exit 1; }

rm -rf "$W/stage" && mkdir -p "$W/stage" || exit 2

# --- the guest's additions: rekv installed as an operator does, a model, the check ----------
env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s install BUILD="$BUILD" DESTDIR="$W/stage" ||
    fail "make install failed"
M=$W/stage/var/lib/rekv/models/model
mkdir -p "$(dirname "$M")" || exit 2
"$BUILD/bin/rekv-loader" synth --arch llama --layers 4 --hidden 64 --heads 4 --kv-heads 2 \
    --ffn 128 --vocab 256 --max-pos 256 --dtype f32 --seed 3 "$M" >/dev/null ||
    fail "rekv-loader synth failed"
chmod -R a+rX "$W/stage/var/lib/rekv"
mkdir -p "$W/stage/usr/local/lib/rekv-boot"
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
# who may submit: a member of the rekv group reaches /run/rekv/control (its own runtime directory
# has no coordinator), a user outside it does not
useradd -M -G rekv alice && useradd -M bob
runuser -u alice -- env XDG_RUNTIME_DIR=/tmp timeout 120 rekv submit --prompt-ids 1,7,42,9 \
    --max-new-tokens 8 --ignore-eos --json >$O/job3.json 2>$O/job3.err; echo $? >$O/job3.rc
runuser -u bob -- env XDG_RUNTIME_DIR=/tmp timeout 60 rekv submit --prompt-ids 1,7,42,9 \
    --max-new-tokens 8 --ignore-eos --json >$O/job4.json 2>$O/job4.err; echo $? >$O/job4.rc
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

tests/vm.sh "$W" --stage "$W/stage" -- /bin/sh /usr/local/lib/rekv-boot/check.sh
rc=$?
[ $rc -eq 0 ] || exit $rc
if [ ! -e "$W/out/done" ]; then
    tail -n 40 "$W/console.log" >&2
    [ -e "$W/out/check.log" ] && tail -n 40 "$W/out/check.log" >&2
    fail "the guest did not finish its check"
fi
exit 0
