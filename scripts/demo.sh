#!/usr/bin/env bash
# make demo: generate a ~1 GiB sample with data and holes, warm part of it as a "working set",
# copy it with lightfoot's defaults, serve it and read it back over NBD, and show the page
# cache before and after.
#
# DEMO_DIR (default target/demo) holds the sample; DEMO_MIB (default 1024, a multiple of 256)
# sets its size and LIGHTFOOT the binary, for tests. The read-back goes through nbdcopy where
# it is installed (a client of another project), else through lightfoot copy's own NBD client.
set -euo pipefail
cd "$(dirname "$0")/.."
lf=${LIGHTFOOT:-$PWD/target/release/lightfoot}
dir=${DEMO_DIR:-$PWD/target/demo}
mib=${DEMO_MIB:-1024}
piece=$((mib / 16))
mkdir -p "$dir"
src=$dir/sample.img dst=$dir/copy.img
if [ ! -f "$src" ] || [ "$(stat -c %s "$src")" != $((mib << 20)) ]; then
  echo "generating $src: $mib MiB, $piece MiB pieces of random data with $piece MiB holes between"
  rm -f "$src"
  truncate -s "${mib}M" "$src"
  for i in 0 2 4 6 8 10 12 14; do
    head -c "${piece}M" /dev/urandom | dd of="$src" bs=1M seek=$((i * piece)) conv=notrunc status=none
  done
  sync "$src"
fi
rm -f "$dst"
$lf cache evict "$src" >/dev/null
ws=$((mib / 8))
echo "reading the first $ws MiB of the sample: the 'working set' that must stay cached"
dd if="$src" of=/dev/null bs=1M count=$ws status=none
sleep 1   # let dd's last readahead complete, then drop what it read past the working set
$lf cache evict --range "${ws}M:" "$src" >/dev/null
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
sock=$dir/demo.sock
back=$dir/readback.img
rm -f "$back"
if command -v nbdcopy >/dev/null; then
  client="nbdcopy" run="nbdcopy \"\$uri\" '$back'"
else
  client="lightfoot copy, lightfoot's own NBD client (nbdcopy is not installed)"
  run="'$lf' copy \"\$uri\" '$back'"
fi
echo "== lightfoot serve $src, read back over NBD through $client"
$lf serve --unix "$sock" --read-only --stats "$src" --run "$run"
echo
echo "== after serving (still only the working set)"
$lf cache stat "$src"
echo
echo "verifying the copies with cmp (this reads them through the cache; evicted again after)"
cmp "$src" "$dst" && echo "copy: identical"
cmp "$src" "$back" && echo "served read-back: identical"
$lf cache evict "$src" "$dst" >/dev/null
rm -f "$back"
