/*
 * dontcache_loop: the smallest cache-neutral file copy we know how to write,
 * kept as the yardstick that bench/copy.sh measures every other job against.
 *
 *     dontcache_loop SRC DST
 *
 * One thread, 4 MiB requests, RWF_DONTCACHE on every read and every write
 * (Linux 6.14+; ext4 and XFS accept it, btrfs and tmpfs answer EOPNOTSUPP),
 * then one fsync. It does nothing clever on purpose: holes in SRC are read as
 * zeroes and written out, there is no second request in flight, no fallback
 * when the flag is refused. If lightfoot is slower than this, that is a bug.
 *
 * Build: gcc -O2 -Wall -o dontcache_loop dontcache_loop.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

/* Debian's headers predate the flag (KERNEL-NOTES: define it yourself). */
#ifndef RWF_DONTCACHE
#define RWF_DONTCACHE 0x80
#endif

#define REQUEST_SIZE (4 << 20)

static void fail(const char *op, const char *path, off_t offset)
{
	if (offset < 0)
		fprintf(stderr, "dontcache_loop: %s %s: %s\n", op, path,
			strerror(errno));
	else
		fprintf(stderr, "dontcache_loop: %s %s at offset %lld: %s\n",
			op, path, (long long)offset, strerror(errno));
	exit(1);
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: dontcache_loop SRC DST\n");
		return 1;
	}
	const char *src = argv[1], *dst = argv[2];

	int in = open(src, O_RDONLY | O_CLOEXEC);
	if (in < 0)
		fail("open", src, -1);
	int out = open(dst, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (out < 0)
		fail("open", dst, -1);
	char *buf = malloc(REQUEST_SIZE);
	if (buf == NULL)
		fail("allocate buffer for", src, -1);

	off_t offset = 0;
	for (;;) {
		struct iovec rd = { .iov_base = buf, .iov_len = REQUEST_SIZE };
		ssize_t got = preadv2(in, &rd, 1, offset, RWF_DONTCACHE);
		if (got < 0) {
			if (errno == EINTR)
				continue;
			fail("read", src, offset);
		}
		if (got == 0)
			break; /* end of file */

		/* A short write is legal: finish the request before reading on. */
		ssize_t done = 0;
		while (done < got) {
			struct iovec wr = { .iov_base = buf + done,
					    .iov_len = got - done };
			ssize_t put = pwritev2(out, &wr, 1, offset + done,
					       RWF_DONTCACHE);
			if (put < 0) {
				if (errno == EINTR)
					continue;
				fail("write", dst, offset + done);
			}
			done += put;
		}
		offset += got;
	}

	/* Success means durable, as for every job in the benchmark. */
	if (fsync(out) < 0)
		fail("fsync", dst, -1);
	if (close(out) < 0)
		fail("close", dst, -1);
	close(in);
	free(buf);
	return 0;
}
