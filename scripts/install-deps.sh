#!/usr/bin/env bash
# Installs what the tests and benchmarks need on a fresh Debian machine: the NBD peers and
# tools the interop tests and benchmarks run against, openssl (the TLS tests make their
# certificates with it), iproute2 (a keepalive test cuts a network namespace's link), and
# mandoc and man-db (tests/install.rs lints and renders the man pages make install writes),
# nbdkit's S3 plugin, and systemd-analyze and systemd-socket-activate (Debian's systemd:
# tests/recipes.rs verifies the example units and runs their command; qemu-nbd and qemu-io,
# which its recipes also run, come with qemu-utils). SeaweedFS, the store tests/s3.rs starts,
# is built from Go by scripts/build-seaweedfs.sh (`make test` runs it). The Linux guest of
# tests/guest.rs and bench/guest.sh boots under qemu-system-x86 from busybox-static and an
# initramfs cpio makes (kmod's depmod lists its modules' dependencies); its kernel is fetched by scripts/guest/build.sh (apt-get download).
# Does nothing when all are present.
set -euo pipefail
need=()
command -v qemu-img  >/dev/null && command -v qemu-nbd >/dev/null && command -v qemu-io >/dev/null || need+=(qemu-utils)
command -v nbdcopy   >/dev/null || need+=(libnbd-bin)
command -v nbdkit    >/dev/null || need+=(nbdkit)
/usr/bin/python3 -c 'import nbd' 2>/dev/null || need+=(python3-libnbd)
command -v fio       >/dev/null || need+=(fio)
command -v nocache   >/dev/null || need+=(nocache)
# tests/run.rs runs rsync under `lightfoot run` (it writes a temporary name and renames it),
# restic (a Go program: the watcher's) and a reader it builds with `gcc -static` (libc.a).
command -v rsync     >/dev/null || need+=(rsync)
command -v restic    >/dev/null || need+=(restic)
command -v gcc       >/dev/null || need+=(gcc)
[ -e /usr/lib/x86_64-linux-gnu/libc.a ] || need+=(libc6-dev)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v mkfs.btrfs >/dev/null || need+=(btrfs-progs)   # a file system without DONTCACHE
[ -x /usr/bin/time ] || need+=(time)
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
dpkg-query -W -f '${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || need+=(busybox-static)
command -v cpio      >/dev/null || need+=(cpio)
command -v depmod    >/dev/null || need+=(kmod)   # the guest kernel's modules.dep
command -v losetup   >/dev/null || need+=(mount)
command -v setpriv   >/dev/null || need+=(util-linux)
command -v openssl   >/dev/null || need+=(openssl)
command -v mksquashfs >/dev/null || need+=(squashfs-tools)
command -v ip >/dev/null && command -v ss >/dev/null || need+=(iproute2)
command -v mandoc    >/dev/null || need+=(mandoc)
command -v man       >/dev/null || need+=(man-db)
command -v systemd-analyze >/dev/null && command -v systemd-socket-activate >/dev/null || need+=(systemd)
# nbdkit's S3 plugin (Python, boto3): tests/s3.rs checks image compatibility with it.
[ -e /usr/lib/x86_64-linux-gnu/nbdkit/plugins/nbdkit-S3-plugin ] || need+=(nbdkit-plugin-python)
/usr/bin/python3 -c 'import boto3' 2>/dev/null || need+=(python3-boto3)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
echo "installing: ${need[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "need root (or sudo) to install: ${need[*]}" >&2; exit 1; }
  sudo=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq "${need[@]}" >/dev/null
