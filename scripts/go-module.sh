# Sourced by scripts/build-*.sh: what building a tool from its Go module takes here.
#
# go_module_source NAME MODULE VERSION: sets $work to a new scratch folder (removed at exit)
# and copies the module's source into $work/src, writable. `go install MODULE@VERSION` is not
# used: it refuses modules whose go.mod has replace directives (SeaweedFS's does).

command -v go >/dev/null || PATH=$PATH:/usr/local/go/bin

go_module_source() {
    name=$1 module=$2 version=$3
    command -v go >/dev/null || { echo "$name: needs the Go toolchain (go)" >&2; exit 1; }
    work=$(mktemp -d)
    trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
    dir=$(go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
    [ -d "$dir" ] || { echo "$name: go mod download gave no folder for $module@$version" >&2; exit 1; }
    cp -R "$dir" "$work/src"
    chmod -R u+w "$work/src"
}
