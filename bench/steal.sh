# Sourced by the benchmarks (bash): how much CPU time the host stole from this VM.
#     mark=$(steal_mark)          # before the work
#     steal=$(steal_pct "$mark")  # after: percent of the machine's CPU time since the mark
# From /proc/stat's "cpu" line: steal over the sum of user..steal, in ticks.
steal_mark() { awk '/^cpu /{t = 0; for (i = 2; i <= 9; i++) t += $i; print t, $9; exit}' /proc/stat; }
steal_pct() {
	local -a a b
	read -r -a a <<<"$1"
	read -r -a b < <(steal_mark)
	echo $(((b[1] - a[1]) * 100 / (b[0] - a[0] > 0 ? b[0] - a[0] : 1)))
}
