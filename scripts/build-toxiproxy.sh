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
command -v go >/dev/null || PATH=$PATH:/usr/local/go/bin
command -v go >/dev/null || { echo "build-toxiproxy: needs the Go toolchain (go) or TOXIPROXY=" >&2; exit 1; }

mkdir -p "$cache"
work=$(mktemp -d)
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
echo "build-toxiproxy: building toxiproxy $VERSION (once)" >&2
dir=$(go mod download -json "github.com/Shopify/toxiproxy/v2@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -d "$dir" ] || { echo "build-toxiproxy: go mod download gave no folder for $VERSION" >&2; exit 1; }
cp -R "$dir" "$work/src"
chmod -R u+w "$work/src"
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
