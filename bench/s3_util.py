#!/usr/bin/python3
"""Helpers of bench/s3.sh (run with Debian's /usr/bin/python3: `trim` needs libnbd's Python
bindings, python3-libnbd, and `rm`/`blocks` boto3, python3-boto3, which nbdkit's S3 plugin needs
anyway). Each subcommand prints one line.

    ports N                        N loopback ports p, each with p + 10000 free too
                                   (SeaweedFS listens for gRPC on port + 10000)
    metrics URL BUCKET             SeaweedFS's S3 request counters for BUCKET, summed over
                                   status codes: JSON {"GET": n, "PUT": n, ...}
    delta BEFORE AFTER             two `metrics` outputs: "get put delete list other"
                                   (the store counts a HEAD as a GET)
    rm ENDPOINT BUCKET KEY         delete KEY and every object under KEY/
    blocks ENDPOINT BUCKET KEY     the number of block objects of image KEY (KEY/ and 16 hex
                                   digits: not lightfoot's manifest)
    trim URI ALIGN                 TRIM the whole NBD export (in requests of at most 4 GiB,
                                   multiples of ALIGN), then FLUSH
    fio FILE read|write            fio's JSON: "ops rate_MiB_s iops"
    lfstats FILE                   lightfoot serve --stats --json's last JSON line in FILE:
                                   "get put delete list head", or "n/a" when it has no "s3"
    lfcopy FILE source|destination lightfoot copy --json's requests on that side, as lfstats
    median X...                    the median
"""
import json
import re
import socket
import statistics
import sys
import urllib.request


def free(port):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def ports(n):
    out = []
    while len(out) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        s.close()
        if p <= 55000 and p not in out and p + 10000 not in out and free(p + 10000):
            out.append(p)
    print(*out)


LINE = re.compile(r'^SeaweedFS_s3_request_total\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$')


def metrics(url, bucket):
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    counts = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        if labels.get("bucket") != bucket:
            continue
        t = labels.get("type", "?")
        counts[t] = counts.get(t, 0) + int(float(m["value"]))
    print(json.dumps(counts, sort_keys=True))


def delta(before, after):
    b, a = json.loads(before), json.loads(after)
    d = {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}
    main = ["GET", "PUT", "DELETE", "LIST"]
    other = sum(v for k, v in d.items() if k not in main)
    print(*[d.get(k, 0) for k in main], other)


def client(endpoint):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


def rm(endpoint, bucket, key):
    s3 = client(endpoint)
    keys = [key]
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/"):
        keys += [o["Key"] for o in page.get("Contents", [])]
    for i in range(0, len(keys), 1000):
        s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
    print(len(keys))


def blocks(endpoint, bucket, key):
    s3 = client(endpoint)
    name = re.compile(re.escape(key) + "/[0-9a-f]{16}$")
    n = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/"):
        n += sum(1 for o in page.get("Contents", []) if name.match(o["Key"]))
    print(n)


def trim(uri, align):
    import nbd

    h = nbd.NBD()
    h.connect_uri(uri)
    size = h.get_size()
    step = ((1 << 32) - 1) // align * align
    off = 0
    while off < size:
        n = min(step, size - off)
        h.trim(n, off)
        off += n
    h.flush()
    h.shutdown()
    print(size)


def fio(path, rw):
    text = open(path).read()
    job = json.loads(text[text.index("{"):])["jobs"][0][rw]
    print(job["total_ios"], f'{job["bw_bytes"] / 2**20:.3f}', f'{job["iops"]:.1f}')


def requests_line(r):
    if not isinstance(r, dict):
        return "n/a"
    return " ".join(str(r.get(k, 0)) for k in ("get", "put", "delete", "list", "head"))


def lfstats(path):
    # HOOK: lightfoot serve --stats --json prints its request counts by type under "s3"
    # (commit 15cf4da); a binary without them prints "n/a" here, and the table shows n/a.
    last = None
    for line in open(path, errors="replace"):
        line = line.strip()
        if line.startswith("{"):
            try:
                last = json.loads(line)
            except ValueError:
                pass
    print(requests_line(last.get("s3") if last else None))


def lfcopy(path, side):
    try:
        j = json.load(open(path))
        print(requests_line(j.get(side, {}).get("requests")))
    except (ValueError, OSError, AttributeError):
        print("n/a")


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "ports":
        ports(int(args[0]))
    elif cmd == "metrics":
        metrics(*args)
    elif cmd == "delta":
        delta(*args)
    elif cmd == "rm":
        rm(*args)
    elif cmd == "blocks":
        blocks(*args)
    elif cmd == "trim":
        trim(args[0], int(args[1]))
    elif cmd == "fio":
        fio(*args)
    elif cmd == "lfstats":
        lfstats(*args)
    elif cmd == "lfcopy":
        lfcopy(*args)
    elif cmd == "median":
        print(f"{statistics.median(float(x) for x in args):.6f}")
    else:
        sys.exit(f"s3_util.py: unknown command {cmd}")


if __name__ == "__main__":
    main()
