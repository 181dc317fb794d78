#!/bin/sh
# Prints how many tests skipped and why, from the lines the tests appended to LOG (one
# `binary::test: reason` per skip, tests/common/mod.rs `skip`): `make test` runs it after the
# tests. A test that skipped parts of itself for several reasons counts once, with each line.
set -eu
log=$1
[ -f "$log" ] || { echo "0 tests skipped"; exit 0; }
n=$(sed 's/: .*//' "$log" | sort -u | grep -c . || true)
case $n in
    0) echo "0 tests skipped" ;;
    1) echo "1 test skipped:" ;;
    *) echo "$n tests skipped:" ;;
esac
sort -u "$log" | sed 's/^/  /'
