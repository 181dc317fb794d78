# servers.sh: sourced by guest.sh and replay.sh: start a server, and read what it used.

# launch LOG CMD...: starts the server CMD in the background, its output in LOG after a
# "+ CMD" line, and sets SERVER_PID; returns 0 once $SOCK and $PIDF exist (it listens and
# wrote its pid), 1 if it exits first or is not there within 10 s.
launch() {
	local log=$1 i
	shift
	rm -f -- "$SOCK" "$PIDF"
	echo "+ $*" >"$log"
	"$@" >>"$log" 2>&1 &
	SERVER_PID=$!
	for ((i = 0; i < 200; i++)); do
		[[ -S $SOCK && -s $PIDF ]] && return 0
		kill -0 "$SERVER_PID" 2>/dev/null || return 1
		sleep 0.05
	done
	return 1
}

# "read_bytes peak_rss_kib cpu_ticks" of a running process, "- - -" if it is gone.
server_usage() {
	local rb hwm cpu
	rb=$(awk '/^read_bytes:/ { print $2 }' "/proc/$1/io" 2>/dev/null) || true
	hwm=$(awk '/^VmHWM:/ { print $2 }' "/proc/$1/status" 2>/dev/null) || true
	# utime + stime, in clock ticks (fields 14 and 15; the name in parentheses may hold spaces).
	cpu=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | awk '{ print $12 + $13 }') || true
	echo "${rb:--} ${hwm:--} ${cpu:--}"
}
CLK_TCK=$(getconf CLK_TCK)

# Bytes of file $1 in the page cache (with the binary $LIGHTFOOT), "-" if unknown.
cached_bytes() {
	"$LIGHTFOOT" cache stat --json "$1" 2>/dev/null |
		python3 -c 'import json,sys; print(json.load(sys.stdin)[0].get("cached_bytes","-"))' 2>/dev/null || echo -
}
