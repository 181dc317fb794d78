#!/usr/bin/env bash
# build.sh: makes the Linux guest that tests/guest.rs and bench/guest.sh boot under QEMU (TCG:
# this machine has no usable KVM): Debian's kernel, fetched with `apt-get download` and
# unpacked, and an initramfs of busybox-static, the kernel modules a virtio disk with ext4
# needs, and scripts/guest/init with the jobs in scripts/guest/jobs/.
#
#     scripts/guest/build.sh        prints the directory holding vmlinuz and initrd.img
#
# The kernel is kept in ~/.cache/lightfoot/guest/KVER/ (XDG_CACHE_HOME is honoured) and
# fetched once; the initramfs is remade whenever init or a job is newer than it. Needs
# qemu-system-x86, busybox-static, cpio and kmod (scripts/install-deps.sh installs them).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "guest/build.sh: $*" >&2; exit 1; }

# The kernel: the version linux-image-amd64 depends on (Debian 12: 6.1), or $GUEST_KERNEL.
pkg=${GUEST_KERNEL:-$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9].*\)$/\1/p' | head -1)}
[[ -n $pkg ]] || die "no kernel package: apt-cache knows no linux-image-amd64 (run apt-get update)"
cache=${XDG_CACHE_HOME:-$HOME/.cache}/lightfoot/guest/${pkg#linux-image-}
mkdir -p "$cache"
if [[ ! -e $cache/vmlinuz ]]; then
	work=$(mktemp -d "$cache/.fetch.XXXXXX")
	trap 'rm -rf "$work"' EXIT
	(cd "$work" && { apt-get download -qq "$pkg" 2>/dev/null || { apt-get update -qq && apt-get download -qq "$pkg"; }; }) \
		>&2 || die "apt-get download $pkg failed"
	dpkg-deb -x "$work"/*.deb "$work/root"
	kver=$(ls "$work/root/lib/modules")
	# The package leaves modules.dep to its postinst: make it here.
	depmod -b "$work/root" "$kver"
	mv "$work/root/lib/modules/$kver" "$cache/modules"
	echo "$kver" >"$cache/modules/version"
	mv "$work/root/boot/vmlinuz-$kver" "$cache/vmlinuz"
	rm -rf "$work"
	trap - EXIT
fi

# The initramfs, remade when a source is newer.
initrd=$cache/initrd.img
if [[ -e $initrd ]] && [[ -z $(find "$here" /bin/busybox -newer "$initrd" -print -quit) ]]; then
	echo "$cache"
	exit 0
fi
command -v cpio >/dev/null || die "cpio is missing (Debian package cpio)"
# The guest has no libc: its busybox must be the static one.
dpkg-query -W -f '${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' ||
	die "busybox-static is not installed (the guest needs a static /bin/busybox)"
mods=$cache/modules
kver=$(cat "$mods/version")
root=$(mktemp -d "$cache/.initrd.XXXXXX")
trap 'rm -rf "$root"' EXIT
mkdir -p "$root"/{bin,dev,proc,sys,mnt,tmp,lib/modules,jobs}
cp /bin/busybox "$root/bin/busybox"
cp "$here/init" "$root/init"
cp "$here"/jobs/* "$root/jobs/"
chmod 755 "$root/init" "$root"/jobs/*

# The modules and what they depend on, in load order (modules.dep lists a module's
# dependencies, deepest last). crc32c is asked for by name at mount time (ext4's metadata
# checksums), which no modprobe answers here: load it up front.
declare -A seen=()
order=()
add() {
	local name=$1 path deps d
	path=$(grep -E "(^|/)$name\.ko(\.xz|\.zst)?:" "$mods/modules.dep" | head -1) || true
	[[ -n $path ]] || return 0 # built in
	deps=${path#*:}
	path=${path%%:*}
	[[ -n ${seen[$path]:-} ]] && return 0
	seen[$path]=1
	for d in $deps; do add "$(basename "$d" | sed -E 's/\.ko(\.xz|\.zst)?$//')"; done
	order+=("$path")
}
for m in virtio_pci virtio_blk crc32c_generic ext4; do add "$m"; done
for p in "${order[@]}"; do
	out=$root/lib/modules/$(basename "$p" | sed -E 's/\.(xz|zst)$//')
	case $p in
		*.xz) xz -dc "$mods/$p" >"$out" ;;
		*.zst) zstd -qdc "$mods/$p" >"$out" ;;
		*) cp "$mods/$p" "$out" ;;
	esac
	basename "$out" >>"$root/lib/modules/order"
done
[[ -s $root/lib/modules/order ]] || die "no modules found for $kver"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) >"$initrd.tmp"
mv "$initrd.tmp" "$initrd"
echo "$cache"
