# store.sh: the object store of the benchmarks that need one (s3.sh, guest.sh), sourced.
#
# SeaweedFS (`weed server -s3`: master, volume, filer and S3 gateway in one process;
# scripts/build-seaweedfs.sh) on loopback ports of its own, data in DIR/weed, started afresh
# and killed by store_stop; with added latency, Toxiproxy (scripts/build-toxiproxy.sh) in front
# of it, a userspace TCP proxy on loopback (this kernel has no netem) whose "latency" toxic
# holds every response LATENCY ms (downstream, jitter 0). At latency 0 clients talk to the
# store directly.
#
# The caller sets HERE (bench/), DIR, UTIL (s3_util.py's command line), BUCKET, and defines
# die and say; WEED and TOXIPROXY may name binaries to use instead of the cached builds (the
# build scripts take them).
#
#   store_start NEED_PROXY   the store (and the proxy if NEED_PROXY is 1), BUCKET created and
#                            writable; sets DIRECT, METRICS (SeaweedFS's Prometheus endpoint),
#                            WEED_PID, TOXI and TOXI_PID
#   store_latency MS         ENDPOINT (and AWS_ENDPOINT_URL) for MS ms added (0: directly; 0p:
#                            through the proxy with nothing added)
#   store_stop               kills both; call it from the caller's EXIT trap
#
# Sourcing it also sets the S3 clients' environment: these keys and nothing of the user's
# (SeaweedFS with no identities configured takes any signature); AWS_ENDPOINT_URL comes with
# store_latency.

WEED_PID="" TOXI_PID="" TOXI=""
while read -r v; do unset "$v"; done < <(env | sed -n 's/^\(AWS_[A-Za-z0-9_]*\)=.*/\1/p')
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench-secret AWS_REGION=us-east-1
export AWS_CONFIG_FILE=/dev/null AWS_SHARED_CREDENTIALS_FILE=/dev/null
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost

store_http() { curl -s -o /dev/null -w '%{http_code}' "$@" || true; }

store_start() {
	local i
	WEED=$("$HERE/../scripts/build-seaweedfs.sh") || die "no SeaweedFS (scripts/build-seaweedfs.sh)"
	if [[ $1 == 1 ]]; then
		TOXI=$("$HERE/../scripts/build-toxiproxy.sh") || die "no Toxiproxy (scripts/build-toxiproxy.sh)"
	fi
	read -r P_MASTER P_VOLUME P_FILER P_S3 P_METRICS P_TAPI P_PROXY <<<"$("${UTIL[@]}" ports 7)"
	DIRECT=http://127.0.0.1:$P_S3
	PROXIED=http://127.0.0.1:$P_PROXY
	TAPI=http://127.0.0.1:$P_TAPI
	METRICS=http://127.0.0.1:$P_METRICS/metrics
	rm -rf -- "$DIR/weed"
	mkdir -p -- "$DIR/weed"
	say "starting SeaweedFS on 127.0.0.1:$P_S3 (S3), data in $DIR/weed"
	# Without the clients' keys: SeaweedFS makes an identity of AWS_ACCESS_KEY_ID and
	# AWS_SECRET_ACCESS_KEY when they are set, and then refuses the anonymous requests of curl.
	# Volumes of 1 GiB (not 30): a vacuum compacts one at a time, so the garbage goes soon.
	env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY "$WEED" server -dir="$DIR/weed" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
		-volume.max=64 -master.volumeSizeLimitMB=1024 -s3 \
		-master.port="$P_MASTER" -volume.port="$P_VOLUME" -filer.port="$P_FILER" -s3.port="$P_S3" \
		-metricsPort="$P_METRICS" >"$DIR/logs/weed.log" 2>&1 &
	WEED_PID=$!
	for ((i = 0; ; i++)); do
		kill -0 "$WEED_PID" 2>/dev/null || die "SeaweedFS exited (see $DIR/logs/weed.log)"
		[[ $(store_http "$DIRECT/") == 200 ]] && break
		((i < 600)) || die "SeaweedFS did not answer within 60 s (see $DIR/logs/weed.log)"
		sleep 0.1
	done
	[[ $(store_http -X PUT "$DIRECT/$BUCKET") == 200 ]] || die "could not create bucket $BUCKET"
	# The first volume is allocated on the first write: wait until one succeeds.
	for ((i = 0; ; i++)); do
		[[ $(store_http -X PUT --data-binary x "$DIRECT/$BUCKET/probe") == 200 ]] && break
		((i < 120)) || die "bucket $BUCKET takes no writes (see $DIR/logs/weed.log)"
		sleep 0.5
	done
	[[ $(curl -s "$METRICS" | grep -c '^SeaweedFS_s3_request_total') -gt 0 ]] ||
		die "SeaweedFS's metrics endpoint $METRICS counts no S3 requests"
	[[ -n $TOXI ]] || return 0
	say "starting Toxiproxy: 127.0.0.1:$P_PROXY -> 127.0.0.1:$P_S3"
	"$TOXI" -host 127.0.0.1 -port "$P_TAPI" >"$DIR/logs/toxiproxy.log" 2>&1 &
	TOXI_PID=$!
	for ((i = 0; ; i++)); do
		[[ $(store_http "$TAPI/version") == 200 ]] && break
		((i < 100)) || die "Toxiproxy did not start (see $DIR/logs/toxiproxy.log)"
		sleep 0.1
	done
	[[ $(store_http -X POST "$TAPI/proxies" -d "{\"name\":\"s3\",\"listen\":\"127.0.0.1:$P_PROXY\",\"upstream\":\"127.0.0.1:$P_S3\",\"enabled\":true}") == 201 ]] ||
		die "Toxiproxy: could not create the proxy"
}

store_latency() {
	if [[ $1 == 0 ]]; then
		ENDPOINT=$DIRECT
	else
		[[ -n $TOXI ]] || die "latency $1 without Toxiproxy (store_start 1)"
		store_http -X DELETE "$TAPI/proxies/s3/toxics/latency" >/dev/null
		if [[ $1 != 0p ]]; then
			[[ $(store_http -X POST "$TAPI/proxies/s3/toxics" -d "{\"name\":\"latency\",\"type\":\"latency\",\"stream\":\"downstream\",\"toxicity\":1.0,\"attributes\":{\"latency\":$1,\"jitter\":0}}") == 200 ]] ||
				die "Toxiproxy: could not set a latency of $1 ms"
		fi
		ENDPOINT=$PROXIED
	fi
	export AWS_ENDPOINT_URL=$ENDPOINT
}

store_stop() {
	local pid i
	for pid in $TOXI_PID; do
		kill -TERM "$pid" 2>/dev/null || true
		for ((i = 0; i < 50; i++)); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
	# SeaweedFS's SIGTERM shutdown can hang with half its parts gone: SIGKILL, as the tests do
	# (its data is scratch).
	if [[ -n $WEED_PID ]]; then
		kill -KILL "$WEED_PID" 2>/dev/null || true
		wait "$WEED_PID" 2>/dev/null || true
	fi
	TOXI_PID="" WEED_PID=""
	rm -rf -- "$DIR/weed"
}
