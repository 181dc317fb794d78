# Sourced by run_mechanism.sh and run_watcher.sh: data_file FILE SIZE makes FILE, SIZE bytes
# of random data (SIZE as numfmt reads it: 1G, 512M), unless it is that size already, and
# prints the size in bytes.
data_file() {
	local want
	want=$(numfmt --from=iec "$2")
	if [[ ! -f $1 || $(stat -c %s "$1") -ne $want ]]; then
		head -c "$want" /dev/urandom >"$1"
		sync
	fi
	echo "$want"
}
