# launch.sh: sourced by guest.sh and replay.sh.
#
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
