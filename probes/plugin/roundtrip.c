/*
 * kph plugin: handler round trips (kph_plugin.h). A vCPU sends an event on its channel
 * and serves the harness's reads, writes and register reads until it says what to do.
 */
#include "kph_plugin.h"

/* ---------------------------------------------------------------- handler round trips */

/* A command header from the harness. A handler usually answers within microseconds:
 * poll for `spin_ns` (CMD_CHANNEL's answer_spin_us) before sleeping in poll(), which
 * saves the wake-up of this (vCPU) thread on the way back. A vCPU asleep when the answer
 * comes is woken by the harness's send(), which then often waits for a core itself: on
 * a 2-core machine that send took 37 us on average with a 40 us poll (its 90th
 * percentile 24-132 us) and 5-15 us with 200 us (6-9 us). */
/* A handler that has not answered in this long is taken for a dead harness: the vCPU
 * goes on (a guest cannot wait forever on a host that hangs). */
#define HANDLER_TIMEOUT_MS 120000
static int read_cmd(int fd, uint32_t h[2], uint64_t spin_ns)
{
    uint64_t t0 = now_ns();
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int r;

    do {
        ssize_t got = recv(fd, h, 8, MSG_DONTWAIT | MSG_PEEK);

        if (got == 8 || got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
            break;
        }
    } while (now_ns() - t0 < spin_ns);
    do {
        r = poll(&pfd, 1, HANDLER_TIMEOUT_MS);
    } while (r < 0 && errno == EINTR);
    if (r == 0) {
        say("kph_plugin: a handler did not answer in 120 s; its vCPU goes on\n");
        return -1;
    }
    return read_full(fd, h, 8);
}

/* Channel ownership, under v->chan_lock: a vCPU in a round trip owns the descriptor it
 * took; the control thread replacing or dropping it then only shuts it down (which
 * wakes the vCPU without freeing the number under it) and the vCPU closes it; otherwise
 * the control thread closes it itself. */
static int chan_take(vcpu_t *v)
{
    int fd;

    pthread_mutex_lock(&v->chan_lock);
    fd = atomic_load(&v->chan);
    v->in_rt = fd >= 0;
    pthread_mutex_unlock(&v->chan_lock);
    return fd;
}

static void chan_release(vcpu_t *v, int fd)
{
    pthread_mutex_lock(&v->chan_lock);
    v->in_rt = 0;
    if (atomic_load(&v->chan) != fd) {
        close(fd);                  /* replaced or dropped while in use */
    }
    pthread_mutex_unlock(&v->chan_lock);
}

/* The channel failed: this vCPU goes on as if every handler returned 0. */
static void chan_dead(vcpu_t *v, int fd)
{
    pthread_mutex_lock(&v->chan_lock);
    v->in_rt = 0;
    if (atomic_load(&v->chan) == fd) {
        atomic_store(&v->chan, -1);
    }
    close(fd);
    pthread_mutex_unlock(&v->chan_lock);
}

/* Control thread: put `fd` (or -1) in place of v's channel. */
void chan_set(vcpu_t *v, int fd)
{
    int old;

    pthread_mutex_lock(&v->chan_lock);
    old = atomic_exchange(&v->chan, fd);
    if (old >= 0) {
        if (v->in_rt) {
            shutdown(old, SHUT_RDWR);
        } else {
            close(old);
        }
    }
    pthread_mutex_unlock(&v->chan_lock);
}

static void write_regs(vcpu_t *v, uint64_t mask, const uint64_t *vals, int with_ip)
{
    int k;

    for (k = 0; k < KREG_NUM; k++) {
        if (!(mask & (1ull << k)) || k == KREG_ORIG_AX || (k == KREG_IP && !with_ip) || !g_reg[k]) {
            continue;
        }
        g_byte_array_set_size(v->gb, 8);
        memcpy(v->gb->data, &vals[k], 8);
        qemu_plugin_write_register(g_reg[k], v->gb);
        v->regs[k] = vals[k];
    }
}

/* Send one event and serve the harness's commands until it says what to do. The ip a
 * handler chose is left in v->new_ip (the caller decides whether it applies); other
 * registers it changed are written here, ip too when `ip_by_register` (discontinuity
 * callbacks, where the PC is a plain register). Returns the action, or -1 when the
 * channel is gone. */
int round_trip(vcpu_t *v, unsigned int vcpu, uint32_t type, uint64_t addr,
               const uint32_t *ids, uint32_t n, uint32_t extra, uint64_t a, uint64_t b,
               int ip_by_register)
{
    int fd = chan_take(v);
    uint8_t *e = v->ev;
    uint32_t vcpu32 = vcpu;

    if (fd < 0) {
        return -1;
    }
    if (n > MAX_PER_SITE) {
        n = MAX_PER_SITE;
    }
    {
        kph_ev_hdr h;

        memset(&h, 0, sizeof(h));
        h.type = type;
        h.vcpu = vcpu32;
        h.n = n;
        h.extra = extra;
        h.addr = addr;
        memcpy(h.regs, v->regs, sizeof(h.regs));
        h.task = v->task;
        h.pid = v->pid;
        h.tflags = v->tflags;
        memcpy(h.comm, v->comm, sizeof(h.comm));
        h.a = a;
        h.b = b;
        memcpy(e, &h, sizeof(h));
    }
    /* up to 4 ids ride in the header's last 16 bytes; more follow it */
    memcpy(e + offsetof(kph_ev_hdr, ids), ids, 4 * (n < 4 ? n : 4));
    if (n > 4) {
        memcpy(e + EV_HDR, ids + 4, 4 * (n - 4));
    }
    v->new_ip = v->regs[KREG_IP];
    if (write_full(fd, e, EV_HDR + 4 * (n > 4 ? n - 4 : 0)) != 0) {
        chan_dead(v, fd);
        return -1;
    }
    for (;;) {
        uint32_t h[2], st;
        uint64_t addr64;

        if (read_cmd(fd, h, atomic_load_explicit(&v->answer_spin_ns, memory_order_relaxed)) != 0) {
            chan_dead(v, fd);
            return -1;
        }
        switch (h[0]) {
        case C_READ: {
            uint32_t len;
            uint8_t *buf = v->rec;

            if (h[1] != 12 || read_full(fd, &addr64, 8) != 0 || read_full(fd, &len, 4) != 0) {
                chan_dead(v, fd);
                return -1;
            }
            if (len > REC_MAX - 8) {
                len = REC_MAX - 8;
            }
            {
                /* EFAULT: a confirmed fault (the guest's); EIO: the read failed where the
                 * memory maps (the plugin's: the harness raises EngineReadError) */
                int before = v->unconfirmed;

                st = len && mem_read(v, addr64, buf + 8, len) == 0 ? 0
                     : v->unconfirmed != before ? EIO : EFAULT;
            }
            memcpy(buf, &st, 4);
            if (st) {
                len = 0;
            }
            memcpy(buf + 4, &len, 4);
            if (write_full(fd, buf, 8 + len) != 0) {
                chan_dead(v, fd);
                return -1;
            }
            break;
        }
        case C_WRITE: {
            uint32_t len = h[1] - 8, out[2] = {0, 0};

            if (h[1] < 8 || h[1] - 8 > REC_MAX || read_full(fd, &addr64, 8) != 0 ||
                read_full(fd, v->rec, len) != 0) {
                chan_dead(v, fd);
                return -1;
            }
            out[0] = len && mem_write(v, addr64, v->rec, len) == 0 ? 0 : EFAULT;
            if (write_full(fd, out, 8) != 0) {
                chan_dead(v, fd);
                return -1;
            }
            break;
        }
        case C_READREG: {
            uint32_t idx;
            uint8_t out[16] = {0};
            uint64_t val;

            if (h[1] != 4 || read_full(fd, &idx, 4) != 0) {
                chan_dead(v, fd);
                return -1;
            }
            st = idx < NSYS && g_sys[idx] ? 0 : EINVAL;
            val = st ? 0 : reg_read(v, g_sys[idx]);
            memcpy(out, &st, 4);
            st = 8;
            memcpy(out + 4, &st, 4);
            memcpy(out + 8, &val, 8);
            if (write_full(fd, out, 16) != 0) {
                chan_dead(v, fd);
                return -1;
            }
            break;
        }
        case C_DONE: {
            /* u32 action, u32 pad, u64 mask, u64 vals[21] */
            uint8_t d[16 + 8 * KREG_NUM];
            uint32_t action;
            uint64_t mask, vals[KREG_NUM];

            if (h[1] != sizeof(d) || read_full(fd, d, sizeof(d)) != 0) {
                chan_dead(v, fd);
                return -1;
            }
            memcpy(&action, d, 4);
            memcpy(&mask, d + 8, 8);
            memcpy(vals, d + 16, sizeof(vals));
            write_regs(v, mask, vals, ip_by_register);
            if (mask & (1ull << KREG_IP)) {
                v->new_ip = vals[KREG_IP];
            }
            chan_release(v, fd);
            return (int)action;
        }
        default:
            chan_dead(v, fd);
            return -1;
        }
    }
}

void arm_post(unsigned int vcpu, vcpu_t *v, uint64_t addr)
{
    v->post_armed = 1;
    v->post_addr = addr;
    if (g_sb) {
        qemu_plugin_u64_set((qemu_plugin_u64){g_sb, 0}, vcpu, 1);
    }
}

void disarm_post(unsigned int vcpu, vcpu_t *v)
{
    v->post_armed = 0;
    v->discon_pending = 0;
    if (g_sb) {
        qemu_plugin_u64_set((qemu_plugin_u64){g_sb, 0}, vcpu, 0);
    }
}

/* The instruction after a probed one is about to run: the post_handlers see the
 * registers after the probed instruction (kprobe_post_process(), 6.1). */
void deliver_post(unsigned int vcpu, vcpu_t *v, uint64_t pc)
{
    int act;
    uint64_t at = v->post_addr;

    disarm_post(vcpu, v);
    read_context(v, pc);
    act = round_trip(v, vcpu, EV_POST, at, NULL, 0, 0, 0, 0, 0);
    if (act == ACT_SETPC && v->new_ip != v->regs[KREG_IP]) {
        qemu_plugin_set_pc(v->new_ip);
    }
}
