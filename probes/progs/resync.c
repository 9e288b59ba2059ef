/* kph-resync [DELTA_NS]: bring a guest restored from a snapshot back in step with the host.
 *
 * Every guest restored from one snapshot wakes up with the clock and the random state of
 * the moment the snapshot was taken. Writing to /dev/urandom only mixes bytes into the
 * input pool: the 6.1 crng keeps handing out the snapshot's keystream until its next
 * scheduled reseed (CRNG_RESEED_INTERVAL, 60 s of jiffies, which the restore also froze),
 * so two restored guests would read identical "random" bytes. Hence: credit the host's
 * random bytes from stdin with RNDADDENTROPY, then force crng_reseed() with
 * RNDRESEEDCRNG; and move CLOCK_REALTIME by DELTA_NS (signed nanoseconds). A delta, not
 * an absolute time: the host measures the offset through the agent's guest-get-time, which
 * answers in milliseconds, while this exec may take a few hundred (TCG translates the exec
 * path afresh after a restore), so an absolute time would be stale by then. */
#include <linux/random.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	struct { struct rand_pool_info info; unsigned char buf[256]; } ent;
	/* buf follows info's flexible array member, so info.buf has room for it */
	ssize_t n = read(0, ent.info.buf, sizeof(ent.buf));
	int fd = open("/dev/urandom", O_WRONLY);
	int rc = 0;

	if (fd < 0) {
		perror("kph-resync: /dev/urandom");
		return 1;
	}
	if (n > 0) {
		ent.info.buf_size = n;
		ent.info.entropy_count = n * 8;
		if (ioctl(fd, RNDADDENTROPY, &ent.info) < 0) {
			perror("kph-resync: RNDADDENTROPY");
			rc = 1;
		}
	}
	if (ioctl(fd, RNDRESEEDCRNG) < 0) {
		perror("kph-resync: RNDRESEEDCRNG");
		rc = 1;
	}
	close(fd);
	if (argc > 1) {
		long long delta = atoll(argv[1]), ns;
		struct timespec ts;

		clock_gettime(CLOCK_REALTIME, &ts);
		ns = ts.tv_sec * 1000000000LL + ts.tv_nsec + delta;
		ts.tv_sec = ns / 1000000000LL;
		ts.tv_nsec = ns % 1000000000LL;
		if (clock_settime(CLOCK_REALTIME, &ts) < 0) {
			perror("kph-resync: clock_settime");
			rc = 1;
		}
	}
	return rc;
}
