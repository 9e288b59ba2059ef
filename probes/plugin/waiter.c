/*
 * kph host-side waiter (not part of the plugin: the harness loads it with ctypes).
 *
 * A Python handler's round trip starts when a vCPU writes an event on its channel. A
 * thread blocked in recv() is woken by the host kernel, ~20-25 us on the project's 2-core
 * machine, more than the handler itself takes. While hits are dense, the channel's
 * thread polls instead, here, outside Python: ctypes releases the GIL for the call, so
 * the spinning thread holds no lock any other Python thread wants.
 */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

static uint64_t now_ns(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* Wait until `fd` has data or is closed: poll it for `spin_ns`, then sleep in poll().
 * 1: readable (data, end of file or an error recv() will report), 0: never (-1 timeout). */
__attribute__((visibility("default")))
int kph_wait_readable(int fd, int64_t spin_ns)
{
    uint64_t t0 = now_ns();
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    char c;
    int r;

    while (spin_ns > 0 && now_ns() - t0 < (uint64_t)spin_ns) {
        ssize_t got = recv(fd, &c, 1, MSG_DONTWAIT | MSG_PEEK);

        if (got >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            return 1;
        }
    }
    do {
        r = poll(&pfd, 1, -1);
    } while (r < 0 && errno == EINTR);
    return r != 0;
}
