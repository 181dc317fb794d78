#!/bin/sh
# Builds SeaweedFS's `weed` (Apache-2.0), the S3-compatible store the object-storage tests and
# benchmarks start on loopback, once per machine, and prints the binary's path.
#
# `WEED=/path/to/weed` skips the build. Otherwise the binary is cached under
# ${XDG_CACHE_HOME:-~/.cache}/lightfoot/ by version: about 5 minutes on 2 cores the first time,
# nothing after. `go install …@version` is refused (SeaweedFS's go.mod has a replace
# directive), so the module is downloaded and built inside a copy of its folder.
#
# The pinned version enforces conditional writes (`If-None-Match: *` answers 412 to a second
# create), which the lease of a writable image relies on.
set -eu

VERSION=v0.0.0-20261109003541-7506e5f91cd6

if [ -n "${WEED:-}" ]; then
    [ -x "$WEED" ] || { echo "build-seaweedfs: WEED=$WEED is not an executable" >&2; exit 1; }
    echo "$WEED"
    exit 0
fi

cache="${XDG_CACHE_HOME:-$HOME/.cache}/lightfoot"
bin="$cache/weed-$VERSION"
if [ -x "$bin" ]; then
    echo "$bin"
    exit 0
fi
. "$(dirname "$0")/go-module.sh"
mkdir -p "$cache"
echo "build-seaweedfs: building weed $VERSION (about 5 minutes, once)" >&2
go_module_source build-seaweedfs github.com/seaweedfs/seaweedfs "$VERSION"
(cd "$work/src" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$work/weed" ./weed)
mv "$work/weed" "$bin"
echo "$bin"
