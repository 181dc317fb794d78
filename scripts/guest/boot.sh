#!/usr/bin/env bash
# boot.sh: boots the guest scripts/guest/build.sh makes, under QEMU with TCG, with NBD exports
# as its disks, runs one job and exits when the guest powers off. The console (every "lf: "
# line of scripts/guest/init and the job) goes to stdout.
#
#     scripts/guest/boot.sh JOB ARG DISK...
#
# JOB is a file in scripts/guest/jobs/, ARG its argument ("" for none). Each DISK is an NBD
# server's Unix socket path or tcp:HOST:PORT, with ro: in front for a read-only disk (a
# read-only export needs it); the first is /dev/vda, the next /dev/vdb, ...
# The drive options are pinned here, for the tests and the benchmarks alike: raw format
# over QEMU's NBD driver, cache=none (the guest sees a volatile write cache, so its FLUSHes
# reach the server, and QEMU caches nothing on the host), discard=unmap (the guest's TRIMs
# reach the server), one virtio disk each.
#
# Environment: GUEST_MEM (MiB, default 512), GUEST_SMP (default 1), GUEST_RECONNECT
# (seconds for QEMU's NBD reconnect-delay; default 0: a lost connection fails the I/O),
# GUEST_READONLY=1 (every disk read-only).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
(($# >= 3)) || { echo "usage: boot.sh JOB ARG DISK..." >&2; exit 2; }
job=$1 arg=$2
shift 2
dir=$("$here/build.sh")
drives=()
for disk in "$@"; do
	ro=${GUEST_READONLY:-0}
	[[ $disk == ro:* ]] && { ro=1; disk=${disk#ro:}; }
	case $disk in
	tcp:*:*) h=${disk#tcp:}; server="file.server.type=inet,file.server.host=${h%:*},file.server.port=${h##*:}" ;;
	*) [[ -S $disk ]] || { echo "boot.sh: $disk is not a socket" >&2; exit 2; }
	   server="file.server.type=unix,file.server.path=$disk" ;;
	esac
	opts="file.driver=nbd,$server,format=raw,if=virtio,cache=none,discard=unmap"
	opts+=",file.reconnect-delay=${GUEST_RECONNECT:-0}"
	[[ $ro = 1 ]] && opts+=",readonly=on"
	drives+=(-drive "$opts")
done
exec qemu-system-x86_64 -accel tcg -m "${GUEST_MEM:-512}" -smp "${GUEST_SMP:-1}" \
	-nodefaults -no-user-config -display none -no-reboot -serial stdio \
	-kernel "$dir/vmlinuz" -initrd "$dir/initrd.img" \
	-append "console=ttyS0 quiet panic=-1 lf.job=$job${arg:+ lf.arg=$arg}" \
	"${drives[@]}" </dev/null
