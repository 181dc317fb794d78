#!/usr/bin/env bash
# make demo: generate a ~1 GiB sample with data and holes, warm part of it as a "working set",
# copy it with lightfoot's defaults, and show the page cache before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
lf=./target/release/lightfoot
dir=${DEMO_DIR:-$PWD/target/demo}
mkdir -p "$dir"
src=$dir/sample.img dst=$dir/copy.img
if [ ! -f "$src" ]; then
  echo "generating $src: 1 GiB, 64 MiB pieces of random data with 64 MiB holes between"
  truncate -s 1G "$src"
  for i in 0 2 4 6 8 10 12 14; do
    head -c 64M /dev/urandom | dd of="$src" bs=1M seek=$((i * 64)) conv=notrunc status=none
  done
  sync "$src"
fi
rm -f "$dst"
$lf cache evict "$src" >/dev/null
echo "reading the first 128 MiB of the sample: the 'working set' that must stay cached"
dd if="$src" of=/dev/null bs=1M count=128 status=none
sleep 1   # let dd's last readahead complete, then drop what it read past the working set
$lf cache evict --range 128M: "$src" >/dev/null
echo
echo "== before"
$lf cache stat "$src"
echo
echo "== lightfoot copy $src $dst"
$lf copy -v "$src" "$dst"
echo
echo "== after (the working set is still cached; nothing else is)"
$lf cache stat "$src" "$dst"
echo
echo "== lightfoot serve $src, read back through nbdcopy (a real NBD client)"
sock=$dir/demo.sock
back=$dir/readback.img
rm -f "$back"
if command -v nbdcopy >/dev/null; then
  $lf serve --unix "$sock" --read-only --stats "$src" --run "nbdcopy \"\$uri\" '$back'"
  echo
  echo "== after serving (still only the working set; the read-back file is nbdcopy's)"
  $lf cache stat "$src"
else
  echo "nbdcopy not installed (make test installs libnbd-bin): skipping"
fi
echo
echo "verifying the copies with cmp (this reads them through the cache; evicted again after)"
cmp "$src" "$dst" && echo "copy: identical"
[ ! -f "$back" ] || { cmp "$src" "$back" && echo "served read-back: identical"; }
$lf cache evict "$src" "$dst" >/dev/null
rm -f "$back"
