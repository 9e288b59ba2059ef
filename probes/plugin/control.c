/*
 * kph plugin: the control channel (kph_plugin.h; the commands are kph_proto.h's). One
 * harness session at a time; every count and index a request carries is bounded here.
 */
#include "kph_plugin.h"

/* ---------------------------------------------------------------- control channel */

int read_full(int fd, void *buf, size_t len)
{
    uint8_t *p = buf;

    while (len) {
        ssize_t r = read(fd, p, len);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return -1;
        }
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

int write_full(int fd, const void *buf, size_t len)
{
    const uint8_t *p = buf;

    while (len) {
        ssize_t r = send(fd, p, len, MSG_NOSIGNAL);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return -1;
        }
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

static int reply(int fd, uint32_t status, const void *data, uint32_t len)
{
    uint32_t h[2] = {status, len};

    if (write_full(fd, h, 8) != 0) {
        return -1;
    }
    return len ? write_full(fd, data, len) : 0;
}

/* Read one request: header {u32 type, u32 len}, the payload, and at most one descriptor. */
static int recv_req(int fd, uint32_t *type, uint8_t **payload, uint32_t *len, int *rfd)
{
    uint32_t h[2];
    struct msghdr msg = {0};
    struct iovec iov = {h, sizeof(h)};
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr *cm;
    ssize_t r;

    *rfd = -1;
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf;
    msg.msg_controllen = sizeof(cbuf);
    do {
        r = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    } while (r < 0 && errno == EINTR);
    if (r <= 0) {
        return -1;
    }
    for (cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            memcpy(rfd, CMSG_DATA(cm), sizeof(int));
        }
    }
    if ((size_t)r < sizeof(h) && read_full(fd, (uint8_t *)h + r, sizeof(h) - (size_t)r) != 0) {
        return -1;
    }
    *type = h[0];
    *len = h[1];
    if (*len > (16u << 20)) {
        return -1;
    }
    *payload = malloc(*len ? *len : 1);
    if (!*payload) {
        return -1;
    }
    if (*len && read_full(fd, *payload, *len) != 0) {
        free(*payload);
        return -1;
    }
    return 0;
}

/* Under g_lock: take a probe out of its site. */
static void unlink_probe(probe *p)
{
    site *s = site_find(p->addr);
    plist *l;
    probe *keep[MAX_PER_SITE];
    int i, n = 0;

    if (atomic_exchange(&p->dead, 1)) {
        return;
    }
    atomic_store(&p->enabled, 0);
    if (p->kind == PK_KPROBE && (p->flags & ADD_POST) && atomic_fetch_sub(&g_n_post, 1) == 1) {
        g_post_off = 1;             /* the caller turns post mode off (a flush) */
    }
    if (!s) {
        return;
    }
    l = atomic_load(&s->list);
    for (i = 0; l && i < l->n; i++) {
        if (l->p[i] != p && n < MAX_PER_SITE) {
            keep[n++] = l->p[i];
        }
    }
    /* Out of memory, the old list stays: the probe is dead, which every callback checks. */
    site_set(s, keep, n);
}

static probe *probe_by_id(uint32_t id)
{
    int i;

    for (i = 0; i < g_nprobes; i++) {
        if (g_probes[i] && g_probes[i]->id == id && !atomic_load(&g_probes[i]->dead)) {
            return g_probes[i];
        }
    }
    return NULL;
}

/* Control thread: the last post_handler went; blocks stop testing for a pending post
 * (one more flush). A vCPU still armed disarms at its next probe hit. */
static void post_mode_check(void)
{
    if (g_post_off) {
        g_post_off = 0;
        if (atomic_load(&g_n_post) == 0 && atomic_load(&g_post_mode)) {
            atomic_store(&g_post_mode, 0);
            reset_all(5000);
        }
    }
}

/* A new harness session starts clean: earlier probes are gone (instances in flight are
 * still serviced at the trampoline). */
static void reset_session(void)
{
    int i;

    pthread_mutex_lock(&g_lock);
    for (i = 0; i < g_nprobes; i++) {
        if (g_probes[i] && !atomic_load(&g_probes[i]->dead)) {
            unlink_probe(g_probes[i]);
            request_invalidate(g_probes[i]->addr);
        }
    }
    pthread_mutex_unlock(&g_lock);
    post_mode_check();
    window_switch(1, 1, 0, NULL, 0, NULL, 0);  /* the window open, a pending switch dropped */
}

static int cmd_ring(const uint8_t *pl, uint32_t len, int fd)
{
    uint64_t size, ctl, total;
    uint32_t n;
    struct stat st;
    void *m;
    ring_t *r;

    if (len < 12 || fd < 0) {
        return EINVAL;
    }
    memcpy(&size, pl, 8);
    memcpy(&n, pl + 8, 4);
    /* one ring per vCPU (fewer would lose the others' records without a word) */
    if (n == 0 || n < (uint32_t)g_nvcpus || n > MAX_VCPUS || size < 65536 ||
        size > RING_MAX_SIZE || (size & (size - 1))) {
        return EINVAL;
    }
    ctl = RING_CTL_OFF + 4096 * (((uint64_t)n * RING_CTL_SIZE + 4095) / 4096);
    if (size > (UINT64_MAX - ctl) / n) {
        return EINVAL;              /* the bounds above exclude it; kept next to the product */
    }
    total = ctl + size * n;
    /* a mapping past the memfd's end would SIGBUS QEMU at the first record */
    if (fstat(fd, &st) != 0) {
        return errno;
    }
    if (st.st_size < 0 || (uint64_t)st.st_size < total) {
        return EINVAL;
    }
    m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        return errno;
    }
    r = calloc(1, sizeof(*r));
    if (!r) {
        munmap(m, total);
        return ENOMEM;
    }
    r->base = m;
    r->size = size;
    r->n = (int)n;
    r->data_off = ctl;
    atomic_store_explicit(&g_ring, r, memory_order_release);
    return 0;
}

/* A probe that was never published (no site list or table slot holds it). */
static void probe_free(probe *p)
{
    free(p->prog);
    free(p->insts);
    free(p->freelist);
    free(p->save);
    free(p->edata_pool);
    free(p);
}

/* Under g_lock: the g_probes slot for a new probe, or -1 when MAX_PROBES are live. Once
 * the table is full, a removed probe's slot is taken again (its struct stays allocated:
 * a callback or a kretprobe instance in flight may still use it), so add/remove cycles
 * never run out. */
static int probe_slot(void)
{
    int i;

    if (g_nprobes < MAX_PROBES) {
        return g_nprobes;
    }
    for (i = 0; i < MAX_PROBES; i++) {
        if (atomic_load(&g_probes[i]->dead)) {
            return i;
        }
    }
    return -1;
}

/* CMD_ADD: u32 id, u32 kind, u64 addr, u32 maxactive, u32 enabled, u32 nprog, u32 pad,
 * kph_insn prog[nprog]. Reply: u32 invalidation state. */
static int cmd_add(int fd, const uint8_t *pl, uint32_t len)
{
    uint32_t id, kind, maxactive, enabled, nprog, st, i, full = 0;
    uint64_t addr, dm = 0;
    probe *p, *list[MAX_PER_SITE];
    site *s;
    plist *l;
    int n = 0, slot, post;

    if (len < 32) {
        return reply(fd, EINVAL, NULL, 0);
    }
    memcpy(&id, pl, 4);
    memcpy(&kind, pl + 4, 4);
    memcpy(&addr, pl + 8, 8);
    memcpy(&maxactive, pl + 16, 4);
    memcpy(&enabled, pl + 20, 4);
    memcpy(&nprog, pl + 24, 4);
    if (kind < PK_SPEC_P || kind > PK_UFREE || nprog > MAX_PROG ||
        len != 32 + nprog * sizeof(kph_insn) + ((enabled & ADD_EXT) ? ADD_EXT_SIZE : 0) ||
        ((kind == PK_SPEC_R || kind == PK_KRET) &&
         (maxactive == 0 || maxactive > KPH_MAX_MAXACTIVE)) ||
        addr == g_tramp) {
        return reply(fd, EINVAL, NULL, 0);
    }
    p = calloc(1, sizeof(*p));
    if (!p) {
        return reply(fd, ENOMEM, NULL, 0);
    }
    p->id = id;
    p->kind = kind;
    p->addr = addr;
    p->nprog = nprog;
    p->regs = kph_prog_regs(NULL, 0);
    if (nprog) {
        p->prog = malloc(nprog * sizeof(kph_insn));
        if (!p->prog) {
            probe_free(p);
            return reply(fd, ENOMEM, NULL, 0);
        }
        memcpy(p->prog, pl + 32, nprog * sizeof(kph_insn));
        if (kph_check_prog(p->prog, nprog) != 0) {
            probe_free(p);
            return reply(fd, EINVAL, NULL, 0);
        }
        p->regs = kph_prog_regs(p->prog, nprog);
        {
            size_t k;
            uint32_t j;

            for (k = 0; k < nprog; k++) {
                if (p->prog[k].op == KOP_CPU_PTR) {
                    p->uses_percpu = 1;
                }
                if (p->prog[k].op != KOP_EDATA) {
                    continue;
                }
                for (j = 0; j < p->nsave && p->save[j] != p->prog[k].imm; j++) {
                }
                if (j == p->nsave) {
                    uint32_t *grown;

                    /* $argN: N <= PARAM_MAX_STACK (kernel/trace/trace_probe.c:
                     * parse_probe_vars()), one saved argument per argument of the line */
                    if (p->nsave >= KPH_MAX_EDATA || p->prog[k].imm >= KPH_THREAD_SIZE / 8) {
                        probe_free(p);
                        return reply(fd, EINVAL, NULL, 0);
                    }
                    grown = realloc(p->save, (p->nsave + 1) * sizeof(*p->save));
                    if (!grown) {
                        probe_free(p);
                        return reply(fd, ENOMEM, NULL, 0);
                    }
                    p->save = grown;
                    p->save[p->nsave++] = (uint32_t)p->prog[k].imm;
                }
            }
        }
    }
    p->flags = enabled;
    p->tramp = g_tramp;
    if (enabled & ADD_EXT) {
        const uint8_t *x = pl + 32 + nprog * sizeof(kph_insn);

        memcpy(&p->tramp, x, 8);
        memcpy(&p->nfilter, x + 8, 4);
        memcpy(p->filter, x + 16, 32);
        memcpy(&p->expect, x + 48, 8);
        memcpy(&dm, x + 56, 8);
        if (dm) {
            atomic_store(&g_direct_map, dm);
        }
        if (p->nfilter > 4 || !p->tramp) {
            probe_free(p);
            return reply(fd, EINVAL, NULL, 0);
        }
        if (p->nfilter) {
            p->mm_off = p->filter[0];       /* the chain starts at task->mm */
            g_mm_off = p->filter[0];
        }
    }
    if (kind == PK_SPEC_R || kind == PK_KRET) {
        p->maxactive = p->nfree = maxactive;
        p->insts = calloc(maxactive, sizeof(inst));
        p->freelist = calloc(maxactive, sizeof(inst *));
        p->edata_pool = p->nsave ? calloc((size_t)maxactive * p->nsave, sizeof(uint64_t)) : NULL;
        if (!p->insts || !p->freelist || (p->nsave && !p->edata_pool)) {
            probe_free(p);
            return reply(fd, ENOMEM, NULL, 0);
        }
        for (i = 0; i < maxactive; i++) {
            p->insts[i].rp = p;
            p->insts[i].edata = p->edata_pool ? p->edata_pool + (size_t)i * p->nsave : NULL;
            p->freelist[i] = &p->insts[i];
        }
    }
    post = kind == PK_KPROBE && (enabled & ADD_POST);
    if (post && atomic_fetch_add(&g_n_post, 1) == 0 && !atomic_load(&g_post_mode)) {
        /* The first post_handler: from now on every block gets the conditional
         * callback, and blocks translated before are flushed once to get it too.
         * (It costs every block an inline test: ~20% on a busy guest; it goes when the
         * last post_handler does.) */
        if (!g_sb) {
            g_sb = qemu_plugin_scoreboard_new(sizeof(uint64_t));
        }
        atomic_store(&g_post_mode, 1);
        reset_all(5000);
    }
    atomic_store(&p->enabled, (enabled & ADD_ENABLED) ? 1 : 0);
    pthread_mutex_lock(&g_lock);
    slot = probe_slot();
    if (slot < 0 || !(s = site_get(addr))) {
        st = ENOSPC;
        full = slot < 0 ? KPH_FULL_PROBES : KPH_FULL_TABLE;
        goto refused;
    }
    if ((kind == PK_SPEC_R || kind == PK_KRET) && p->tramp != g_tramp) {
        site *t = site_get(p->tramp);   /* a uretprobe's trampoline in its program */

        if (!t) {
            st = ENOSPC;            /* its returns could not be serviced */
            full = KPH_FULL_TABLE;
            goto refused;
        }
        t->tramp = 1;
    }
    list[n++] = p;                  /* newest first */
    l = atomic_load(&s->list);
    for (i = 0; l && i < (uint32_t)l->n; i++) {
        if (atomic_load(&l->p[i]->dead)) {
            continue;
        }
        if (n == MAX_PER_SITE) {
            /* a full site refuses the newcomer (evicting a live probe would lose it
             * without a word) */
            st = ENOSPC;
            full = KPH_FULL_SITE;
            goto refused;
        }
        list[n++] = l->p[i];
    }
    if (site_set(s, list, n) != 0) {
        st = ENOMEM;
        goto refused;
    }
    p->born = ++g_born;
    g_probes[slot] = p;
    if (slot == g_nprobes) {
        g_nprobes++;
    }
    pthread_mutex_unlock(&g_lock);
    if (enabled & ADD_FLUSH) {
        /* User code: the probed file's page has no one virtual address to write through
         * (the current process may not map it): what was translated at this address
         * (and at its return trampoline) in any process, or everything (kph_plugin.c:
         * user_invalidate) */
        uint64_t at[2] = {addr, p->tramp};

        st = (uint32_t)user_invalidate(at, 2);
    } else if (enabled & ADD_NO_INVALIDATE) {
        st = INVAL_SKIPPED;         /* tests: show what a probe without it misses */
    } else {
        request_invalidate(addr);
        st = (uint32_t)wait_invalidated(2000);
    }
    return reply(fd, 0, &st, 4);

refused:
    pthread_mutex_unlock(&g_lock);
    if (post && atomic_fetch_sub(&g_n_post, 1) == 1) {
        g_post_off = 1;
    }
    post_mode_check();
    probe_free(p);
    return reply(fd, st, full ? &full : NULL, full ? 4 : 0);
}

int serve(int fd)
{
    for (;;) {
        uint32_t type, len, st = 0;
        uint8_t *pl = NULL;
        int rfd = -1, rc = 0;

        if (recv_req(fd, &type, &pl, &len, &rfd) != 0) {
            return -1;
        }
        switch (type) {
        case CMD_HELLO: {
            uint32_t out[4] = {KPH_PROTO, (uint32_t)g_nvcpus, KPH_QEMU_PLUGIN_API,
                               (uint32_t)atomic_load(&g_regs_ready)};
            reset_session();
            atomic_store(&g_fail_hi, 0);
            atomic_store(&g_live, 1);
            rc = reply(fd, 0, out, sizeof(out));
            break;
        }
        case CMD_RING:
            rc = reply(fd, (uint32_t)cmd_ring(pl, len, rfd), NULL, 0);
            if (rfd >= 0) {
                close(rfd);
            }
            break;
        case CMD_CONFIG:
            /* u64 current_task, u64 pid offset, u64 comm offset, u64 trampoline,
             * u64 flags (CFG_*)[, u64 kernel rethook trampoline, u64 return_to_handler
             * [, u64 this_cpu_off's per-cpu offset[, u64 current_kprobe's
             * [, u64 preempt_count()'s[, u64 task_struct.mm's offset, u64
             * cpu_tlbstate.loaded_mm's per-cpu offset]]]]] */
            if (len != 40 && len != 56 && len != 64 && len != 72 && len != 80 && len != 96) {
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            pthread_mutex_lock(&g_lock);
            {
                uint64_t f;
                memcpy(&f, pl + 32, 8);
                atomic_store(&g_cfg_flags, f);
                if (len >= 56) {
                    memcpy(&f, pl + 40, 8);
                    atomic_store(&g_ktramp_rethook, f);
                    memcpy(&f, pl + 48, 8);
                    atomic_store(&g_ktramp_fgraph, f);
                }
                if (len >= 64) {
                    memcpy(&g_this_cpu_off, pl + 56, 8);
                }
                if (len >= 72) {
                    memcpy(&f, pl + 64, 8);
                    atomic_store(&g_current_kprobe, f);
                }
                if (len >= 80) {
                    memcpy(&g_preempt_off, pl + 72, 8);
                }
                if (len >= 96) {
                    memcpy(&g_uacc_mm_off, pl + 80, 8);
                    memcpy(&g_loaded_mm_off, pl + 88, 8);
                }
            }
            memcpy(&g_cur_task_off, pl, 8);
            memcpy(&g_pid_off, pl + 8, 8);
            memcpy(&g_comm_off, pl + 16, 8);
            {
                uint64_t t;
                site *ts;

                memcpy(&t, pl + 24, 8);
                if (t && (!g_tramp || t == g_tramp)) {
                    ts = site_get(t);
                    if (!ts) {
                        st = ENOSPC;    /* returns to it could not be serviced */
                    } else {
                        g_tramp = t;
                        g_tramp_site = ts;
                    }
                    if (ts && !g_tramp_site->tramp) {
                        g_tramp_site->tramp = 1;
                        pthread_mutex_unlock(&g_lock);
                        request_invalidate(t);
                        wait_invalidated(2000);
                        pthread_mutex_lock(&g_lock);
                    }
                } else if (t && t != g_tramp) {
                    st = EBUSY;     /* instances may be in flight at the old one */
                }
            }
            pthread_mutex_unlock(&g_lock);
            rc = reply(fd, st, NULL, 0);
            break;
        case CMD_ADD:
            rc = cmd_add(fd, pl, len);
            break;
        case CMD_ARRANGE: {
            /* u64 addr, u32 n, u32 pad, u32 ids[n]: the site's probes in that order first,
             * the others after them as they were (fprobes on 7.3 run by ops group) */
            uint64_t addr;
            uint32_t n, i, j, k = 0, id;
            probe *list[MAX_PER_SITE];
            site *ts;
            plist *l;

            if (len < 16) {
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            memcpy(&addr, pl, 8);
            memcpy(&n, pl + 8, 4);
            if (n > MAX_PER_SITE || len != 16 + 4 * (size_t)n) {
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            pthread_mutex_lock(&g_lock);
            ts = site_find(addr);
            l = ts ? atomic_load(&ts->list) : NULL;
            if (!l) {
                st = ENOENT;
            } else {
                /* each of the site's probes once (an id named twice counts once), at
                 * most MAX_PER_SITE: list[] and every per-site array hold no more */
                for (i = 0; i < n; i++) {
                    memcpy(&id, pl + 16 + 4 * i, 4);
                    for (j = 0; j < (uint32_t)l->n && k < MAX_PER_SITE; j++) {
                        uint32_t m;

                        if (l->p[j]->id != id || atomic_load(&l->p[j]->dead)) {
                            continue;
                        }
                        for (m = 0; m < k && list[m] != l->p[j]; m++) {
                        }
                        if (m == k) {
                            list[k++] = l->p[j];
                        }
                        break;
                    }
                }
                for (j = 0; j < (uint32_t)l->n; j++) {
                    for (i = 0; i < k && list[i] != l->p[j]; i++) {
                    }
                    if (i == k && !atomic_load(&l->p[j]->dead) && k < MAX_PER_SITE) {
                        list[k++] = l->p[j];
                    }
                }
                if (site_set(ts, list, (int)k) != 0) {
                    st = ENOMEM;
                }
            }
            pthread_mutex_unlock(&g_lock);
            rc = reply(fd, st, NULL, 0);
            break;
        }
        case CMD_CHANNEL: {
            /* u32 vcpu [, u32 answer_spin_us], one descriptor: that vCPU's handler channel */
            uint32_t i32 = 0, spin_us = KPH_ANSWER_SPIN_US;
            vcpu_t *v;

            if (len >= 4) {
                memcpy(&i32, pl, 4);
            }
            if (len >= 8) {
                memcpy(&spin_us, pl + 4, 4);
            }
            v = vc(i32);
            if (!v || rfd < 0 || spin_us > 1000000) {
                if (rfd >= 0) {
                    close(rfd);
                }
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            atomic_store(&v->answer_spin_ns, spin_us * 1000ull);
            chan_set(v, rfd);
            rc = reply(fd, 0, NULL, 0);
            break;
        }
        case CMD_REMOVE:
        case CMD_ENABLE: {
            uint32_t id = 0, on = 0;
            probe *p;

            if (len < 4) {
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            memcpy(&id, pl, 4);
            if (len >= 8) {
                memcpy(&on, pl + 4, 4);
            }
            pthread_mutex_lock(&g_lock);
            p = probe_by_id(id);
            if (!p) {
                st = ENOENT;
            } else if (type == CMD_REMOVE) {
                unlink_probe(p);
            } else {
                atomic_store(&p->enabled, on ? 1 : 0);
            }
            pthread_mutex_unlock(&g_lock);
            if (p && type == CMD_REMOVE) {
                /* Drop the callback from translations too: no cost left behind. */
                request_invalidate(p->addr);
                wait_invalidated(2000);
                post_mode_check();
            }
            rc = reply(fd, st, NULL, 0);
            break;
        }
        case CMD_STATS: {
            uint64_t out[3] = {0};
            uint32_t id = 0;
            probe *p = NULL;
            int i;

            if (len >= 4) {
                memcpy(&id, pl, 4);
            }
            pthread_mutex_lock(&g_lock);
            for (i = 0; i < g_nprobes; i++) {
                if (g_probes[i] && g_probes[i]->id == id && (!p || g_probes[i]->born > p->born)) {
                    p = g_probes[i];    /* a removed one's stats too, unless its slot was reused */
                }
            }
            pthread_mutex_unlock(&g_lock);
            if (!p) {
                rc = reply(fd, ENOENT, NULL, 0);
                break;
            }
            out[0] = atomic_load(&p->nhit);
            out[1] = atomic_load(&p->nmissed);
            pthread_mutex_lock(&rp_lock);
            out[2] = p->maxactive - p->nfree;
            pthread_mutex_unlock(&rp_lock);
            rc = reply(fd, 0, out, sizeof(out));
            break;
        }
        case CMD_GSTATS: {
            uint64_t out[KPH_NGSTATS];

            out[0] = atomic_load(&inval_count);
            out[1] = atomic_load(&inval_ns_total);
            out[2] = atomic_load(&g_tramp_missing);
            out[3] = atomic_load(&g_seq);
            out[4] = atomic_load(&g_n_irq);
            out[5] = atomic_load(&g_n_exc);
            out[6] = atomic_load(&g_n_post_insn);
            out[7] = atomic_load(&g_n_post_tb);
            out[8] = atomic_load(&g_n_post_irq);
            out[9] = atomic_load(&g_n_flush);
            out[10] = atomic_load(&g_n_filtered);
            out[11] = atomic_load(&g_uret_inherited);
            out[12] = atomic_load(&g_uret_forked);
            out[13] = atomic_load(&g_kret_flushed);
            out[14] = atomic_load(&g_tramp_overflow);
            out[15] = atomic_load(&g_n_unconfirmed);
            out[16] = atomic_load(&g_uret_freed);
            rc = reply(fd, 0, out, sizeof(out));
            break;
        }
        case CMD_FAILREAD: {
            uint64_t lo, n;

            if (len != 16) {
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            memcpy(&lo, pl, 8);
            memcpy(&n, pl + 8, 8);
            if (n && lo + n < lo) {
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            atomic_store(&g_fail_hi, 0);
            atomic_store(&g_fail_lo, lo);
            atomic_store(&g_fail_hi, n ? lo + n : 0);
            rc = reply(fd, 0, NULL, 0);
            break;
        }
        case CMD_INVALIDATE: {
            uint64_t a;

            uint32_t mode = 0;

            if (len != 8 && len != 12) {
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            memcpy(&a, pl, 8);
            if (len == 12) {
                memcpy(&mode, pl + 8, 4);
            }
            if (mode == 1) {
                st = (uint32_t)reset_all(5000);
            } else {
                request_invalidate(a);
                st = (uint32_t)wait_invalidated(2000);
            }
            rc = reply(fd, 0, &st, 4);
            break;
        }
        case CMD_WINDOW: {
            uint32_t on, nw, nr;

            if (len < 8) {
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            memcpy(&on, pl, 4);
            memcpy(&nw, pl + 4, 4);
            nr = 0;
            if (nw <= MAX_WIN_WRITES && len >= 12 + 32 * nw) {
                memcpy(&nr, pl + 8 + 32 * nw, 4);
            }
            if (nw > MAX_WIN_WRITES || (on & ~3u) || nr > MAX_WIN_READS ||
                (len != 8 + 32 * nw && len != 12 + 32 * nw + 8 * nr) || ((on & 2u) && nr)) {
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            for (uint32_t i = 0; i < nw; i++) {
                uint32_t size;

                memcpy(&size, pl + 8 + 32 * i + 8, 4);
                if (size != 1 && size != 2 && size != 4 && size != 8) {
                    nw = UINT32_MAX;
                    break;
                }
            }
            if (nw == UINT32_MAX) {
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            /* bit 0: open; bit 1: now (no guest write, a pending switch dropped) */
            st = (uint32_t)window_switch((int)(on & 1), (int)(on >> 1), (int)nw, pl + 8,
                                         (int)nr, pl + 12 + 32 * nw, 1000);
            rc = reply(fd, 0, &st, 4);
            break;
        }
        case CMD_MARKS: {
            static uint8_t out[16 + 16 * MAX_WIN_READS];

            if (len != 0) {
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
            rc = reply(fd, 0, out, (uint32_t)window_marks(out));
            break;
        }
        default:
            rc = reply(fd, ENOSYS, NULL, 0);
        }
        free(pl);
        if (rc != 0) {
            return -1;
        }
    }
}

void *ctl_thread(void *arg)
{
    (void)arg;
    for (;;) {
        int fd = accept4(g_ctl_fd, NULL, NULL, SOCK_CLOEXEC);

        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) {
                continue;
            }
            say("kph_plugin: control socket closed; plugin inert\n");
            atomic_store(&g_live, 0);
            return NULL;
        }
        serve(fd);
        /* The harness went away: no new hits until the next session, and its probes go
         * (their translations are invalidated, as for a removal). Returns in flight are
         * still serviced at the trampoline. */
        atomic_store(&g_live, 0);
        close(fd);
        for (int i = 0; i < MAX_VCPUS; i++) {
            if (g_vcpu[i]) {
                chan_set(g_vcpu[i], -1);    /* a vCPU waiting on a handler goes on */
            }
        }
        reset_session();
    }
}
