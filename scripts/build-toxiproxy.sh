#!/bin/sh
# Builds Toxiproxy (MIT), the TCP proxy bench/s3.sh puts in front of the object store to add
# latency on loopback (this kernel has no `netem`), once per machine, and prints the path of
# `toxiproxy-server`. `toxiproxy-cli` is built beside it (the benchmark itself drives the
# server's HTTP API with curl and does not need the cli).
#
# `TOXIPROXY=/path/to/toxiproxy-server` skips the build. Otherwise the binaries are cached
# under ${XDG_CACHE_HOME:-~/.cache}/lightfoot/toxiproxy-VERSION/ : well under a minute on
# 2 cores the first time, nothing after. Built from the Go module
# github.com/Shopify/toxiproxy/v2 (`go list -m -versions github.com/Shopify/toxiproxy/v2`
# lists the versions the module proxy has), downloaded and built inside a copy of its folder
# as scripts/build-seaweedfs.sh does.
set -eu

VERSION=v2.5.0

if [ -n "${TOXIPROXY:-}" ]; then
    [ -x "$TOXIPROXY" ] || { echo "build-toxiproxy: TOXIPROXY=$TOXIPROXY is not an executable" >&2; exit 1; }
    echo "$TOXIPROXY"
    exit 0
fi

cache="${XDG_CACHE_HOME:-$HOME/.cache}/lightfoot"
dest="$cache/toxiproxy-$VERSION"
if [ -x "$dest/toxiproxy-server" ] && [ -x "$dest/toxiproxy-cli" ]; then
    echo "$dest/toxiproxy-server"
    exit 0
fi
. "$(dirname "$0")/go-module.sh"
mkdir -p "$cache"
echo "build-toxiproxy: building toxiproxy $VERSION (once)" >&2
go_module_source build-toxiproxy github.com/Shopify/toxiproxy/v2 "$VERSION"
(
    cd "$work/src"
    # The version the binaries report (`toxiproxy-server -version`), as upstream's Makefile sets it.
    ld="-s -w -X github.com/Shopify/toxiproxy/v2.Version=$VERSION"
    CGO_ENABLED=0 go build -trimpath -ldflags "$ld" -o "$work/out/toxiproxy-server" ./cmd/server
    CGO_ENABLED=0 go build -trimpath -ldflags "$ld" -o "$work/out/toxiproxy-cli" ./cmd/cli
)
rm -rf "$dest"
mv "$work/out" "$dest"
echo "$dest/toxiproxy-server"
