/*
 * kph_plugin: host-side kprobes inside QEMU, as a TCG plugin (kprobe-harness issue 15).
 *
 * Loaded with `-plugin kph_plugin.so,ctl=FD` (FD: a listening UNIX socket the harness
 * created in the machine's private run directory). Inert until the harness connects and
 * adds probes; when that connection ends the plugin goes inert again (no new hits),
 * but keeps servicing return addresses it hijacked, so the guest never returns into the
 * trampoline unserviced.
 *
 * The harness side is harness/machine/pluginlink.py (protocol, ring) and harness/engines/plugin_engine.py
 * (kprobe semantics); harness/kernel/grammar/program.py compiles fetch args for fetch.c.
 *
 * How a probe works: at translation, every instruction whose address has a probe gets an
 * instruction callback, which runs on that vCPU's thread before the instruction, while
 * the other vCPUs keep running. Probes added later must reach code translated before:
 * the plugin writes the probed instruction's first byte back unchanged through
 * qemu_plugin_write_memory_vaddr(), which goes through the physical-memory write path
 * and invalidates every translation block holding that byte (tb_invalidate_phys_range).
 * That write needs a vCPU context, so a vCPU does it at its next callback: an interrupt
 * or exception (discontinuity callback), leaving idle, or any probe hit.
 *
 * Spec probes (kprobe_events lines) run their compiled fetch program (fetch.c) and
 * append a record to the vCPU's ring, a shared memory area the harness drains; there
 * is no round trip. Kretprobes follow kernel/kprobes.c (Linux 6.1):
 * pre_handler_kretprobe() takes an instance from a pool of maxactive (nmissed when it is
 * empty), the return address is replaced on the stack by the trampoline, and at the
 * trampoline the instances of that stack slot are handled newest first, as
 * rethook_trampoline_handler() walks a task's rethook nodes, then the vCPU jumps to the
 * real return address (qemu_plugin_set_pc).
 *
 * The wire protocol (commands, probe kinds, flags, limits, record and event headers) is
 * kph_proto.h, shared with nothing but the harness's spelling of it (pluginlink.py, held
 * to it by tests/unit/test_plugin_build.py). Every count and index a request carries is
 * bounded here before use.
 *
 * Why one file of ~2,600 lines: every part shares the lock-free site table, the
 * per-vCPU state and the callback contexts QEMU allows (set_pc only where registered
 * with RW_REGS_PC, memory writes only from a vCPU); splitting it would mean a header
 * exposing all of them. It is in sections, in this order: site table, invalidation,
 * registers and memory, ring, kretprobes, handler round trips, callbacks (where a hit
 * is handled, post and fault delivery, translation), full flush, control channel,
 * install. fetch.c (the fetch programs) has no QEMU in it and is tested on its own.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "qemu-plugin.h"
#include "fetch.h"

KPH_EXPORT int qemu_plugin_version = KPH_QEMU_PLUGIN_API;

#include "kph_proto.h"

#define MAX_VCPUS KPH_MAX_VCPUS
#define TABLE_SIZE 16384            /* power of two; sites are never removed */
#define MAX_PROBES KPH_MAX_PROBES
#define MAX_PER_SITE KPH_MAX_PER_SITE
#define MAX_PROG KPH_MAX_PROG
#define REC_MAX KPH_REC_MAX
#define MAX_PENDING 1024            /* more pending invalidations: one full flush */
#define RING_MAX_SIZE (1ull << 30)  /* bytes of ring per vCPU, at most */
#define LIVE_SIZE 4096              /* buckets of live kretprobe instances */
/* the instances one return slot may hold at once: each return probe of a site, a
 * kretprobe and an fprobe of the same call (two sites), and stale ones under them */
#define MAX_PER_SLOT (2 * MAX_PER_SITE)

typedef struct probe {
    uint32_t id, kind;
    uint64_t addr;
    atomic_int enabled;
    atomic_int dead;
    kph_insn *prog;
    size_t nprog;
    atomic_uint_fast64_t nhit, nmissed;
    /* kretprobe instances, under rp_lock */
    uint32_t maxactive, nfree, flags;
    /* uprobes: where its returns go, and which processes it is for: the chain
     * current->mm->exe_file->f_inode->i_ino must end in `expect` (kernel/events/
     * uprobes.c places a uprobe on an inode: every mm mapping that file) */
    uint64_t tramp;
    uint32_t nfilter;
    uint64_t filter[4];
    uint64_t expect;
    uint64_t mm_off;
    struct inst *insts;
    struct inst **freelist;
    uint64_t born;                  /* the order of adds (CMD_STATS: the newest of an id) */
    /* a return probe's $argN (KOP_EDATA): the arguments its entry saves, in first-use
     * order (__store_entry_arg()); its program adds the per-cpu offset (KOP_CPU_PTR) */
    uint8_t nsave, save[8];
    int uses_percpu;
} probe;

typedef struct inst {
    probe *rp;
    uint64_t slot, ret_addr, task;
    uint64_t mm;                    /* user return probes: the address space of the slot */
    uint64_t edata[8];              /* the arguments the entry saved (probe.save) */
    struct inst *next;              /* same bucket of the live table */
} inst;

typedef struct {
    int n;
    probe *p[];
} plist;

typedef struct site {
    uint64_t addr;
    _Atomic(plist *) list;
    int tramp;
    uint32_t len;                   /* the instruction's length, seen at translation */
} site;

typedef struct {
    /* the record being built, and scratch buffers for the API */
    uint8_t rec[REC_MAX];
    GByteArray *gb;
    uint64_t regs[KREG_NUM];
    uint64_t task;
    int32_t pid;
    char comm[16];
    uint32_t tflags;
    atomic_int idle;
    /* Python handlers: this vCPU's channel, and a post_handler waiting for the next
     * instruction (the one after the probed instruction at post_addr) */
    atomic_int chan;
    pthread_mutex_t chan_lock;
    int in_rt;
    int unconfirmed;                /* reads that failed where the page translates */
    int post_armed;
    int discon_pending;             /* 1 interrupt, 2 exception, while a post is pending */
    uint64_t post_addr;
    uint64_t new_ip;
    uint8_t ev[EV_HDR + 4 * MAX_PER_SITE];
} vcpu_t;

/* ring layout (kph_proto.h): header, per-vCPU control blocks, per-vCPU data areas */
typedef struct {
    _Atomic uint64_t head;          /* producer */
    _Atomic uint64_t dropped;
    _Atomic uint64_t records;
    uint64_t pad[5];
    _Atomic uint64_t tail;          /* consumer (the harness) */
} ring_ctl;

static qemu_plugin_id_t g_id;
static int g_nvcpus;
static vcpu_t *g_vcpu[MAX_VCPUS];
static atomic_int g_live;           /* a harness is connected and probes may fire */
static int g_ctl_fd = -1;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;   /* control-side changes */
static _Atomic(site *) g_table[TABLE_SIZE];
static probe *g_probes[MAX_PROBES];
static int g_nprobes;               /* slots used; removed probes' slots are reused */
static uint64_t g_born;
static uint64_t g_tramp;
static site *g_tramp_site;
static uint64_t g_cur_task_off, g_pid_off, g_comm_off;
static uint64_t g_this_cpu_off;     /* per-cpu offset of this_cpu_off (CMD_CONFIG) */
static uint64_t g_mm_off;           /* task_struct.mm, once a user return probe exists */
/* CMD_CONFIG flags (kph_proto.h): CFG_URET_SYSCALL, the kernel's 64-bit uretprobe trampoline
 * pushes rax, rcx and r11 and calls sys_uretprobe() (6.11+, arch/x86/kernel/uprobes.c) */
static _Atomic uint64_t g_cfg_flags;
/* CMD_CONFIG's eighth word: the per-cpu address of current_kprobe (kprobe_running()) */
static _Atomic uint64_t g_current_kprobe;
/* CMD_CONFIG's optional tail: what the guest kernel writes in a return-address slot it
 * hooks (arch_rethook_trampoline; return_to_handler for ADD_FGRAPH probes), which a
 * program reading a slot the plugin hooked sees instead of the plugin's trampoline */
static _Atomic uint64_t g_ktramp_rethook, g_ktramp_fgraph;
static atomic_uint_fast64_t g_seq;
static atomic_uint_fast64_t g_tramp_missing;
static atomic_uint_fast64_t g_tramp_overflow;   /* instances past MAX_PER_SLOT at one return */
static atomic_uint_fast64_t g_kret_flushed;     /* instances of dead tasks (rethook_flush_task) */
static atomic_uint_fast64_t g_uret_freed;       /* user ones at exit or exec (uprobe_free_utask) */
static atomic_uint_fast64_t g_uret_inherited;   /* fork children's inherited user slots */
static atomic_uint_fast64_t g_uret_forked;      /* user return instances copied at a fork */
/* counts for GSTATS: discontinuities seen (interrupts, exceptions), posts delivered by
 * path (next instruction, next block, interrupt), full flushes */
static atomic_uint_fast64_t g_n_irq, g_n_exc, g_n_post_insn, g_n_post_tb, g_n_post_irq, g_n_flush;
static atomic_uint_fast64_t g_n_filtered;   /* uprobe hits of another program */

/* registers, by pt_regs index, and the two GS bases */
static struct qemu_plugin_register *g_reg[KREG_NUM];
static struct qemu_plugin_register *g_gs_base, *g_kgs_base;
/* system registers a handler may read (regs.read_sys), by index */
#define NSYS 9
static const char *const sys_names[NSYS] = {
    "cr0", "cr2", "cr3", "cr4", "cr8", "efer", "fs_base", "gs_base", "k_gs_base",
};
static struct qemu_plugin_register *g_sys[NSYS];
/* post_handlers: once one exists, every translation block starts with a conditional
 * callback that fires on a vCPU whose scoreboard entry says a post is pending */
static atomic_int g_post_mode;
static atomic_int g_n_post;         /* live probes with a post or fault handler */
static int g_post_off;              /* control thread: the last one went */
static struct qemu_plugin_scoreboard *g_sb;
static atomic_int g_regs_ready;

/* the ring */
typedef struct {
    uint8_t *base;
    uint64_t size;                  /* per vCPU, power of two */
    uint64_t data_off;
    int n;
} ring_t;
/* A session's ring; a new session's replaces it and the old mapping is kept (a callback
 * may still be writing into it), so nothing is ever unmapped under a vCPU. */
static _Atomic(ring_t *) g_ring;

/* kretprobes */
static pthread_mutex_t rp_lock = PTHREAD_MUTEX_INITIALIZER;
static inst *g_live_tab[LIVE_SIZE];

/* invalidation */
static pthread_mutex_t inval_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t inval_cond = PTHREAD_COND_INITIALIZER;
static uint64_t inval_addr[MAX_PENDING];
static int inval_n;
static int inval_overflow;          /* more than MAX_PENDING: a full flush serves them all */
static uint64_t inval_flush_upto;   /* the requests the next full flush completes */
static atomic_int inval_pending;
static uint64_t inval_requested, inval_done;
static atomic_uint_fast64_t inval_count, inval_ns_total;
static uint64_t inval_t0;

static uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + ts.tv_nsec;
}

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    char buf[256];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    qemu_plugin_outs(buf);
}

static vcpu_t *vc(unsigned int i)
{
    return i < MAX_VCPUS ? g_vcpu[i] : NULL;
}

/* ---------------------------------------------------------------- site table */

static unsigned int slot_of(uint64_t addr)
{
    return (unsigned int)((addr * 0x9E3779B97F4A7C15ull) >> 50) & (TABLE_SIZE - 1);
}

static site *site_find(uint64_t addr)
{
    unsigned int i = slot_of(addr), n;

    for (n = 0; n < TABLE_SIZE; n++, i = (i + 1) & (TABLE_SIZE - 1)) {
        site *s = atomic_load_explicit(&g_table[i], memory_order_acquire);
        if (!s) {
            return NULL;
        }
        if (s->addr == addr) {
            return s;
        }
    }
    return NULL;
}

/* Under g_lock. */
static site *site_get(uint64_t addr)
{
    unsigned int i = slot_of(addr), n;

    for (n = 0; n < TABLE_SIZE; n++, i = (i + 1) & (TABLE_SIZE - 1)) {
        site *s = atomic_load_explicit(&g_table[i], memory_order_acquire);
        if (!s) {
            s = calloc(1, sizeof(*s));
            if (!s) {
                return NULL;
            }
            s->addr = addr;
            atomic_store_explicit(&g_table[i], s, memory_order_release);
            return s;
        }
        if (s->addr == addr) {
            return s;
        }
    }
    return NULL;
}

/* Replace a site's probe list (old lists are leaked: a callback may still read one). A
 * list holds at most MAX_PER_SITE probes: the per-hit arrays (ids[], the event's ids) are
 * that size. */
static int site_set(site *s, probe **ps, int n)
{
    plist *l;

    if (n < 0 || n > MAX_PER_SITE) {
        return -1;
    }
    l = malloc(sizeof(*l) + sizeof(probe *) * (n ? n : 1));
    if (!l) {
        return -1;
    }
    l->n = n;
    memcpy(l->p, ps, sizeof(probe *) * n);
    atomic_store_explicit(&s->list, l, memory_order_release);
    return 0;
}

/* ---------------------------------------------------------------- invalidation */

static void request_invalidate(uint64_t addr)
{
    pthread_mutex_lock(&inval_lock);
    if (inval_n < MAX_PENDING) {
        inval_addr[inval_n++] = addr;
    } else {
        inval_overflow = 1;         /* never dropped: see service_invalidations() */
    }
    if (!atomic_load(&inval_pending)) {
        inval_t0 = now_ns();
    }
    inval_requested++;
    atomic_store(&inval_pending, 1);
    pthread_mutex_unlock(&inval_lock);
}

/* In a vCPU context: rewrite the first byte of each pending address with itself, which
 * invalidates the translations that hold it. When more were requested than the list
 * holds, the whole translation cache is flushed instead (qemu_plugin_reset(), the one
 * full flush the plugin API offers); they are done when on_reset_done() says so. */
static void service_reset(void);
static atomic_int reset_wanted;

static void service_invalidations(vcpu_t *v)
{
    uint64_t addrs[MAX_PENDING], upto;
    int n, i, overflow;

    service_reset();
    if (!atomic_load_explicit(&inval_pending, memory_order_relaxed)) {
        return;
    }
    if (pthread_mutex_trylock(&inval_lock) != 0) {
        return;
    }
    n = inval_n;
    overflow = inval_overflow;
    memcpy(addrs, inval_addr, sizeof(uint64_t) * n);
    inval_n = 0;
    inval_overflow = 0;
    upto = inval_requested;
    if (overflow && upto > inval_flush_upto) {
        inval_flush_upto = upto;
    }
    atomic_store(&inval_pending, 0);
    pthread_mutex_unlock(&inval_lock);
    if (overflow) {
        /* A reset already in flight is not started again (plugin_reset_uninstall()), but
         * its flush runs after this callback (exclusive work), so it covers these too. */
        atomic_fetch_add(&inval_count, n);
        atomic_store(&reset_wanted, 1);
        service_reset();
        return;
    }
    for (i = 0; i < n; i++) {
        g_byte_array_set_size(v->gb, 0);
        if (qemu_plugin_read_memory_vaddr(addrs[i], v->gb, 1)) {
            qemu_plugin_write_memory_vaddr(addrs[i], v->gb);
        }
    }
    pthread_mutex_lock(&inval_lock);
    if (upto > inval_done) {
        inval_done = upto;
    }
    atomic_fetch_add(&inval_count, n);
    atomic_fetch_add(&inval_ns_total, now_ns() - inval_t0);
    pthread_cond_broadcast(&inval_cond);
    pthread_mutex_unlock(&inval_lock);
}

static int all_idle(void)
{
    int i;

    for (i = 0; i < g_nvcpus; i++) {
        if (g_vcpu[i] && !atomic_load(&g_vcpu[i]->idle)) {
            return 0;
        }
    }
    return 1;
}

/* Control thread: wait until the invalidations requested so far are done. */
static int wait_invalidated(int timeout_ms)
{
    struct timespec dl;
    uint64_t want;
    int rc = INVAL_DONE;

    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&inval_lock);
    want = inval_requested;
    while (inval_done < want) {
        struct timespec step;

        /* An idle vCPU runs nothing before it leaves idle, and then it invalidates
         * first; so a machine whose vCPUs all idle is as good as invalidated. */
        if (all_idle()) {
            rc = INVAL_IDLE;
            break;
        }
        clock_gettime(CLOCK_REALTIME, &step);
        step.tv_nsec += 2000000L;
        if (step.tv_nsec >= 1000000000L) {
            step.tv_sec++;
            step.tv_nsec -= 1000000000L;
        }
        if (step.tv_sec > dl.tv_sec || (step.tv_sec == dl.tv_sec && step.tv_nsec > dl.tv_nsec)) {
            step = dl;
        }
        if (pthread_cond_timedwait(&inval_cond, &inval_lock, &step) == ETIMEDOUT) {
            struct timespec t;

            clock_gettime(CLOCK_REALTIME, &t);
            if (t.tv_sec > dl.tv_sec || (t.tv_sec == dl.tv_sec && t.tv_nsec >= dl.tv_nsec)) {
                rc = inval_done < want ? INVAL_PENDING : INVAL_DONE;
                break;
            }
        }
    }
    pthread_mutex_unlock(&inval_lock);
    return rc;
}

/* ---------------------------------------------------------------- registers and memory */

static uint64_t reg_read(vcpu_t *v, struct qemu_plugin_register *h)
{
    uint64_t val = 0;

    if (!h) {
        return 0;
    }
    g_byte_array_set_size(v->gb, 0);
    if (!qemu_plugin_read_register(h, v->gb)) {
        return 0;
    }
    memcpy(&val, v->gb->data, v->gb->len < 8 ? v->gb->len : 8);
    return val;
}

/* CMD_FAILREAD (tests): reads overlapping [g_fail_lo, g_fail_hi) fail although they map */
static _Atomic uint64_t g_fail_lo, g_fail_hi;
static atomic_uint_fast64_t g_n_unconfirmed;

static int read_once(vcpu_t *v, uint64_t addr, void *buf, size_t len)
{
    uint64_t hi = atomic_load_explicit(&g_fail_hi, memory_order_relaxed);

    if (hi && addr < hi && addr + len > atomic_load(&g_fail_lo)) {
        return -1;
    }
    g_byte_array_set_size(v->gb, 0);
    if (!qemu_plugin_read_memory_vaddr(addr, v->gb, len) || v->gb->len < len) {
        return -1;
    }
    memcpy(buf, v->gb->data, len);
    return 0;
}

/* Guest virtual memory through this vCPU. A failed read is a fault only when it is
 * confirmed: some page of the range does not translate (the guest's own access would
 * fault: copy_from_kernel_nofault() returns -EFAULT). A read that fails where every page
 * translates is read again; failing twice it is the plugin's failure, not the guest's
 * (counted in v->unconfirmed: the record says RF_UNCONFIRMED and the harness fails the
 * hit, as the gdbstub engine raises EngineReadError when its raw re-read works). */
static int mem_read(void *ctx, uint64_t addr, void *buf, size_t len)
{
    vcpu_t *v = ctx;
    uint64_t page, last, hw;

    if (len == 0 || read_once(v, addr, buf, len) == 0) {
        return 0;
    }
    if (addr + len - 1 < addr) {
        return -1;                  /* wraps past the top: no guest access reaches it */
    }
    last = (addr + len - 1) >> 12;
    for (page = addr >> 12; page <= last; page++) {
        uint64_t a = page == addr >> 12 ? addr : page << 12;

        if (!qemu_plugin_translate_vaddr(a, &hw)) {
            return -1;              /* confirmed: it does not map */
        }
    }
    if (read_once(v, addr, buf, len) == 0) {
        return 0;
    }
    v->unconfirmed++;
    atomic_fetch_add_explicit(&g_n_unconfirmed, 1, memory_order_relaxed);
    return -1;
}

/* mem_read() for a probe's program: a kernel return-address slot the plugin hooked
 * reads as the guest kernel's own hook would have left it (the trampoline of the last
 * hook of that slot), as a fetch of it does in the kernel after a return probe at the
 * same place hooked the call ($stack0 at an fprobe entry). */
static unsigned int live_bucket(uint64_t slot);

static int prog_read(void *ctx, uint64_t addr, void *buf, size_t len)
{
    uint64_t s, val;
    inst *ri;

    if (mem_read(ctx, addr, buf, len) != 0) {
        return -1;
    }
    if (addr < 0xffff800000000000ull || !atomic_load(&g_ktramp_rethook)) {
        return 0;
    }
    pthread_mutex_lock(&rp_lock);
    for (s = (addr - 7) & ~7ull; s < addr + len; s += 8) {
        for (ri = g_live_tab[live_bucket(s)]; ri; ri = ri->next) {
            if (ri->slot == s && ri->mm == 0) {
                break;                  /* the newest hook of the slot is first */
            }
        }
        if (!ri) {
            continue;
        }
        val = (ri->rp->flags & ADD_FGRAPH) ? atomic_load(&g_ktramp_fgraph)
                                           : atomic_load(&g_ktramp_rethook);
        for (unsigned int i = 0; i < 8 && val; i++) {
            if (s + i >= addr && s + i < addr + len) {
                ((uint8_t *)buf)[s + i - addr] = (uint8_t)(val >> (8 * i));
            }
        }
    }
    pthread_mutex_unlock(&rp_lock);
    return 0;
}

static int mem_write(vcpu_t *v, uint64_t addr, const void *buf, size_t len)
{
    g_byte_array_set_size(v->gb, len);
    memcpy(v->gb->data, buf, len);
    return qemu_plugin_write_memory_vaddr(addr, v->gb) ? 0 : -1;
}

/* The pt_regs of this hit, and `current` with its pid and comm (read through the
 * per-cpu current_task at the kernel's GS base: in user mode that base waits in
 * MSR_KERNEL_GS_BASE until swapgs).
 *
 * `pc` is where the vCPU is: in an instruction callback TCG has not stored rip for
 * instructions past the block's first, so the caller says (from translation time);
 * 0 means rip is current (discontinuity callbacks). The same goes for the arithmetic
 * flags, which TCG computes lazily and the plugin API cannot reach: in an instruction
 * callback `flags` holds IF and the other system bits, not ZF/SF/CF/... (README). */
static void read_context(vcpu_t *v, uint64_t pc)
{
    int i;
    uint64_t base;

    for (i = 0; i < KREG_NUM; i++) {
        if (i != KREG_IP || !pc) {
            v->regs[i] = reg_read(v, g_reg[i]);
        }
    }
    if (pc) {
        v->regs[KREG_IP] = pc;
    }
    v->regs[KREG_ORIG_AX] = ~0ull;
    v->tflags = 0;
    v->task = 0;
    v->pid = 0;
    memset(v->comm, 0, sizeof(v->comm));
    if (!g_cur_task_off) {
        return;
    }
    base = reg_read(v, (v->regs[KREG_CS] & 3) == 3 ? g_kgs_base : g_gs_base);
    if (mem_read(v, base + g_cur_task_off, &v->task, 8) != 0) {
        return;
    }
    v->tflags |= RF_TASK;
    if (g_pid_off && mem_read(v, v->task + g_pid_off, &v->pid, 4) == 0) {
        v->tflags |= RF_PID;
    }
    if (g_comm_off && mem_read(v, v->task + g_comm_off, v->comm, 16) == 0) {
        v->tflags |= RF_COMM;
    }
}

/* ---------------------------------------------------------------- ring */

static ring_ctl *ring_ctl_of(ring_t *r, int i)
{
    return (ring_ctl *)(r->base + RING_CTL_OFF + (size_t)i * RING_CTL_SIZE);
}

/* Append one record (size a multiple of 8) to vCPU i's ring; drop it when full. */
static void ring_put(int i, const uint8_t *rec, uint32_t size)
{
    ring_t *r = atomic_load_explicit(&g_ring, memory_order_acquire);
    ring_ctl *c;
    uint8_t *data;
    uint64_t head, tail, pos, g_ring_size;

    if (!r || i >= r->n) {
        return;
    }
    g_ring_size = r->size;
    c = ring_ctl_of(r, i);
    data = r->base + r->data_off + (size_t)i * g_ring_size;
    head = atomic_load_explicit(&c->head, memory_order_relaxed);
    tail = atomic_load_explicit(&c->tail, memory_order_acquire);
    pos = head & (g_ring_size - 1);
    if (pos + size > g_ring_size) {
        uint32_t pad = (uint32_t)(g_ring_size - pos);
        uint16_t type = REC_PAD;

        if (head + pad + size - tail > g_ring_size) {
            atomic_fetch_add(&c->dropped, 1);
            return;
        }
        memcpy(data + pos, &pad, 4);
        memcpy(data + pos + 4, &type, 2);
        head += pad;
        pos = 0;
    }
    if (head + size - tail > g_ring_size) {
        atomic_fetch_add(&c->dropped, 1);
        return;
    }
    memcpy(data + pos, rec, size);
    atomic_fetch_add_explicit(&c->records, 1, memory_order_relaxed);
    atomic_store_explicit(&c->head, head + size, memory_order_release);
}

/* Build and append a record: header (240 bytes), then the captured blocks. */
static void emit(vcpu_t *v, unsigned int vcpu, probe *p, uint16_t type, uint64_t func,
                 uint64_t ret_addr, const inst *ri)
{
    kph_capture cap = {
        .buf = v->rec + REC_HDR, .cap = REC_MAX - REC_HDR, .read = prog_read, .read_ctx = v,
        .task = v->task,
    };
    uint32_t size;

    v->unconfirmed = 0;             /* counted by mem_read() from here to the header */
    if (ri) {
        cap.edata = ri->edata;
        cap.edata_idx = p->save;
        cap.nedata = p->nsave;
    }
    if (p->uses_percpu && g_this_cpu_off) {
        uint64_t base = reg_read(v, (v->regs[KREG_CS] & 3) == 3 ? g_kgs_base : g_gs_base);

        cap.has_percpu = mem_read(v, base + g_this_cpu_off, &cap.percpu, 8) == 0;
    }
    kph_rec_hdr h;
    uint32_t flags = v->tflags;
    uint64_t seq = atomic_fetch_add(&g_seq, 1);

    if (p->nprog && kph_capture_args(&cap, p->prog, p->nprog, v->regs) < 0) {
        flags |= RF_BADPROG;
    }
    if (cap.truncated) {
        flags |= RF_TRUNC;
    }
    if (v->unconfirmed) {
        flags |= RF_UNCONFIRMED;
    }
    memset(&h, 0, sizeof(h));
    h.size = (uint32_t)(REC_HDR + cap.len);
    h.type = type;
    h.vcpu = (uint16_t)vcpu;
    h.probe_id = p->id;
    h.nblocks = cap.nblocks;
    h.seq = seq;
    memcpy(h.regs, v->regs, sizeof(h.regs));
    h.task = v->task;
    h.func = func;
    h.ret_addr = ret_addr;
    h.pid = v->pid;
    h.flags = flags;
    memcpy(h.comm, v->comm, sizeof(h.comm));
    memcpy(v->rec, &h, sizeof(h));
    size = h.size;
    ring_put(vcpu, v->rec, size);
}

/* ---------------------------------------------------------------- kretprobes */

static unsigned int live_bucket(uint64_t slot)
{
    return (unsigned int)((slot >> 3) * 0x9E3779B97F4A7C15ull >> 52) & (LIVE_SIZE - 1);
}

static int round_trip(vcpu_t *v, unsigned int vcpu, uint32_t type, uint64_t addr,
                      const uint32_t *ids, uint32_t n, uint32_t extra, uint64_t a, uint64_t b,
                      int ip_by_register);

/* current->mm (user return probes key their instances by it: two processes may hold
 * the same stack slot address). 0 when unknown. */
static uint64_t task_mm(vcpu_t *v, uint64_t mm_off)
{
    uint64_t mm = 0;

    if (!(v->tflags & RF_TASK) || mem_read(v, v->task + mm_off, &mm, 8) != 0) {
        return 0;
    }
    return mm;
}

/* Does this hit belong to the probe (a uprobe's exe-inode filter)? */
static int filter_ok(vcpu_t *v, probe *p)
{
    uint64_t val;
    uint32_t i;

    if (!p->nfilter) {
        return 1;
    }
    if (!(v->tflags & RF_TASK)) {
        return 0;
    }
    val = v->task;
    for (i = 0; i < p->nfilter; i++) {
        if (!val || mem_read(v, val + p->filter[i], &val, 8) != 0) {
            return 0;
        }
    }
    return val == p->expect;
}

/* store_trace_entry_data() of the entry handler (6.12+, trace_kprobe.c and trace_fprobe.c):
 * each argument a return line's $argN reads, regs_get_kernel_argument() (past the sixth,
 * the stack: regs_get_kernel_stack_nth(), 0 outside the stack or on a fault) */
static void save_entry_args(vcpu_t *v, const probe *p, inst *ri)
{
    static const uint8_t areg[6] = {KREG_DI, KREG_SI, KREG_DX, KREG_CX, KREG_R8, KREG_R9};
    uint8_t i;

    for (i = 0; i < p->nsave; i++) {
        uint8_t n = p->save[i];
        uint64_t sp = v->regs[KREG_SP], a, val = 0;

        if (n < 6) {
            val = v->regs[areg[n]];
        } else {
            a = sp + 8 * (uint64_t)(n - 5);
            if ((a & ~(uint64_t)(KPH_THREAD_SIZE - 1)) != (sp & ~(uint64_t)(KPH_THREAD_SIZE - 1)) ||
                mem_read(v, a, &val, 8) != 0) {
                val = 0;
            }
        }
        ri->edata[i] = val;
    }
}

/* pre_handler_kretprobe(): take an instance or count nmissed, run the entry_handler
 * (non-zero: no return probe for this call), hijack [sp]. */
static void kret_entry(unsigned int vcpu, vcpu_t *v, probe *p)
{
    uint64_t slot = v->regs[KREG_SP], ret;
    inst *ri;
    unsigned int b;

    pthread_mutex_lock(&rp_lock);
    if (p->nfree == 0) {
        pthread_mutex_unlock(&rp_lock);
        atomic_fetch_add(&p->nmissed, 1);
        if (p->kind == PK_KRET) {   /* the harness keeps rp->nmissed as the kernel does */
            round_trip(v, vcpu, EV_MISS, p->addr, &p->id, 1, 0, 0, 0, 0);
        }
        return;
    }
    ri = p->freelist[--p->nfree];
    if (p->kind == PK_KRET && !(p->flags & ADD_NO_ENTRY_RT)) {
        uint32_t idx = (uint32_t)(ri - p->insts);
        int act;

        pthread_mutex_unlock(&rp_lock);
        act = round_trip(v, vcpu, EV_RET_ENTRY, p->addr, &p->id, 1, idx, 0, slot, 0);
        pthread_mutex_lock(&rp_lock);
        if (act == ACT_DISCARD) {
            p->freelist[p->nfree++] = ri;
            pthread_mutex_unlock(&rp_lock);
            return;
        }
    }
    if (mem_read(v, slot, &ret, 8) != 0 || mem_write(v, slot, &p->tramp, 8) != 0) {
        p->freelist[p->nfree++] = ri;
        pthread_mutex_unlock(&rp_lock);
        atomic_fetch_add(&p->nmissed, 1);
        return;
    }
    ri->slot = slot;
    ri->ret_addr = ret;
    ri->task = v->task;
    save_entry_args(v, p, ri);
    ri->mm = p->mm_off ? task_mm(v, p->mm_off) : 0;
    b = live_bucket(slot);
    ri->next = g_live_tab[b];
    g_live_tab[b] = ri;
    pthread_mutex_unlock(&rp_lock);
    atomic_fetch_add(&p->nhit, 1);
}

/* uprobe_copy_process(t, flags) (kernel/events/uprobes.c, 6.1 to 7.3), at its entry: a
 * child with an mm of its own (a fork) gets a copy of each user return instance of the
 * current task (dup_utask()), so that its returns through a copied slot are serviced,
 * and recorded, as its own. A thread shares the mm and gets none; a vfork child (the
 * same mm, CLONE_VFORK) is not mirrored: its copies would share the parent's keys. */
static void user_fork(vcpu_t *v)
{
    uint64_t child = v->regs[KREG_DI], pmm, cmm = 0;
    inst *from[64], *ri;
    int n = 0, i;
    unsigned int b;

    if (!g_mm_off || !(v->tflags & RF_TASK)) {
        return;
    }
    pmm = task_mm(v, g_mm_off);
    if (!pmm || mem_read(v, child + g_mm_off, &cmm, 8) != 0 || !cmm || cmm == pmm) {
        return;
    }
    pthread_mutex_lock(&rp_lock);
    for (b = 0; b < LIVE_SIZE; b++) {
        for (ri = g_live_tab[b]; ri && n < 64; ri = ri->next) {
            if (ri->mm == pmm && ri->task == v->task && ri->rp->tramp != g_tramp) {
                from[n++] = ri;
            }
        }
    }
    /* oldest first, each at its bucket's head: the copies keep the originals' order
     * (a slot's newest hook first: on_trampoline() stops at the one holding the real
     * return address) */
    for (i = n - 1; i >= 0; i--) {
        probe *p = from[i]->rp;
        inst *c;

        if (p->nfree == 0) {
            atomic_fetch_add(&p->nmissed, 1);
            continue;
        }
        c = p->freelist[--p->nfree];
        memcpy(c->edata, from[i]->edata, sizeof(c->edata));
        c->slot = from[i]->slot;
        c->ret_addr = from[i]->ret_addr;
        c->task = child;
        c->mm = cmm;
        b = live_bucket(c->slot);
        c->next = g_live_tab[b];
        g_live_tab[b] = c;
        atomic_fetch_add(&g_uret_forked, 1);
    }
    pthread_mutex_unlock(&rp_lock);
}

/* user == 0: rethook_flush_task(tk) (kernel/trace/rethook.c; called from
 * delayed_put_task_struct(), kernel/exit.c, in 6.1, 6.12 and 7.3): a task that died inside
 * a hooked function (do_exit() never returns) gives its return instances back to their
 * pools (rethook_recycle()), with no handler. Here: every kernel return instance the plugin
 * took for that task (its kretprobes' and 6.12's rethook fprobe exits'; 7.3's fprobe exits
 * on the function graph die with the task's shadow stack likewise).
 * user == 1: uprobe_free_utask(t) (kernel/events/uprobes.c; called from mm_release(),
 * kernel/fork.c, at exit and exec, 6.1 to 7.3): the task's user return instances
 * (utask->return_instances) are freed, with no handler. */
static void flush_task(uint64_t task, int user)
{
    unsigned int b;
    inst **pp, *ri;

    if (!task) {
        return;
    }
    pthread_mutex_lock(&rp_lock);
    for (b = 0; b < LIVE_SIZE; b++) {
        for (pp = &g_live_tab[b]; (ri = *pp) != NULL;) {
            if (ri->task == task && (user ? ri->rp->tramp != g_tramp
                                          : ri->mm == 0 && ri->rp->tramp == g_tramp)) {
                *pp = ri->next;
                ri->rp->freelist[ri->rp->nfree++] = ri;
                atomic_fetch_add(user ? &g_uret_freed : &g_kret_flushed, 1);
            } else {
                pp = &ri->next;
            }
        }
    }
    pthread_mutex_unlock(&rp_lock);
}

/* kprobe_running() on this vCPU: the guest's per-cpu current_kprobe is set while one of
 * its own kprobe handlers runs (kernel/kprobes.c; the x86 int3 and ftrace handlers then
 * count the hit missed and call no handler). Read once per hit (*cache: -1 unread). */
static int guest_kprobe_running(vcpu_t *v, int *cache)
{
    uint64_t off = atomic_load_explicit(&g_current_kprobe, memory_order_relaxed), cur = 0;

    if (*cache < 0) {
        *cache = 0;
        if (off && (v->regs[KREG_CS] & 3) != 3 &&
            read_once(v, reg_read(v, g_gs_base) + off, &cur, 8) == 0) {
            *cache = cur != 0;
        }
    }
    return *cache;
}

/* The kernel trampoline a hook of the guest kernel would have written where done[j]
 * hooked (its counterpart's: return_to_handler or arch_rethook_trampoline); the
 * plugin's own trampoline when the harness was not told them (older config). */
static uint64_t kernel_tramp(const inst *ri, uint64_t tramp)
{
    uint64_t k = (ri->rp->flags & ADD_FGRAPH) ? atomic_load(&g_ktramp_fgraph)
                                              : atomic_load(&g_ktramp_rethook);
    return k ? k : tramp;
}

/* The return address a return record of done[i] shows (done[] newest first, the last
 * holding the real one). Not stacked: the real one. A kretprobe's: what its own hook
 * saved (get_kretprobe_retaddr(): the previous hook's trampoline). An fprobe's through
 * rethook (6.12): the real one (rethook_trampoline_handler()'s correct_ret_addr);
 * through the function graph (7.3): what the slot held when the graph hooked, the
 * trampoline of the newest older hook that is not the graph's (all of a call's fprobe
 * exits are one graph hook), or the real one. */
static uint64_t shown_ret(inst **done, int n, int i, uint64_t tramp, uint64_t real)
{
    const probe *p = done[i]->rp;
    int j;

    if (tramp != g_tramp || done[i]->ret_addr != tramp || i + 1 >= n) {
        return done[i]->ret_addr == tramp && tramp == g_tramp ? tramp : real;
    }
    if (!(p->flags & ADD_FTRACE_OPS)) {
        return kernel_tramp(done[i + 1], tramp);
    }
    if (!(p->flags & ADD_FGRAPH)) {
        return real;
    }
    for (j = i + 1; j < n; j++) {
        if (!(done[j]->rp->flags & ADD_FGRAPH)) {
            return kernel_tramp(done[j], tramp);
        }
    }
    return real;
}

/* The guest returned into a trampoline: [sp - 8] was the hijacked slot (in a user
 * trampoline, of this process's mm: handle_trampoline(), kernel/events/uprobes.c, finds
 * the task's return instances). */
static void on_trampoline(unsigned int vcpu, vcpu_t *v, uint64_t tramp)
{
    inst *done[MAX_PER_SLOT];
    int n = 0, i, k, uret_frame;
    uint64_t slot, real = 0, mm = 0;
    unsigned int b;

    read_context(v, tramp);
    slot = v->regs[KREG_SP] - 8;
    b = live_bucket(slot);
    if (tramp != g_tramp && g_mm_off) {
        mm = task_mm(v, g_mm_off);
    }
    pthread_mutex_lock(&rp_lock);
    /* Newest first; an instance whose saved address is the trampoline itself was taken
     * by a later kretprobe on the same frame: go on to the one below it. */
    for (;;) {
        inst **pp = &g_live_tab[b], *ri = NULL;

        while (*pp) {
            if ((*pp)->slot == slot && (*pp)->mm == mm) {
                ri = *pp;
                *pp = ri->next;
                break;
            }
            pp = &(*pp)->next;
        }
        if (!ri) {
            break;
        }
        if (n < MAX_PER_SLOT) {
            done[n++] = ri;
        } else {
            /* more than any slot can hold (not expected): back to its pool without a
             * handler rather than lost to it (counted) */
            ri->rp->freelist[ri->rp->nfree++] = ri;
            atomic_fetch_add(&g_tramp_overflow, 1);
        }
        if (ri->ret_addr != tramp) {
            real = ri->ret_addr;
            break;
        }
    }
    if (!real && tramp != g_tramp) {
        /* A fork child returning through a slot it copied from its parent (same address,
         * another mm): no handler, but the real return address (the gdbstub engine's
         * rule, harness.engines.uprobes: _on_trampoline()). The parent's instance stays. */
        inst *ri;

        for (ri = g_live_tab[b]; ri; ri = ri->next) {
            if (ri->slot == slot && ri->rp->tramp == tramp && ri->ret_addr != tramp) {
                real = ri->ret_addr;
                break;
            }
        }
        pthread_mutex_unlock(&rp_lock);
        if (real) {
            atomic_fetch_add(&g_uret_inherited, 1);
            qemu_plugin_set_pc(real);
            return;
        }
    } else {
        pthread_mutex_unlock(&rp_lock);
    }
    if (!real) {
        /* Nothing of ours: let the guest run into whatever is there (and count it). */
        atomic_fetch_add(&g_tramp_missing, 1);
        return;
    }
    /* rethook_trampoline_handler(): handlers see ip = the real return address. */
    v->regs[KREG_IP] = real;
    uret_frame = tramp != g_tramp && (atomic_load(&g_cfg_flags) & CFG_URET_SYSCALL);
    if (uret_frame) {
        /* uretprobe_trampoline_entry pushed rax, rcx, r11: struct uretprobe_syscall_args
         * at sp - 24 (SYSCALL_DEFINE0(uretprobe)), which the handlers see below sp */
        uint64_t args[3] = {v->regs[KREG_R11], v->regs[KREG_CX], v->regs[KREG_AX]};

        mem_write(v, v->regs[KREG_SP] - 24, args, sizeof(args));
    }
    /* A kernel frame's handlers run from the last hooked down (rethook: the task's list).
     * A user frame's run in consumer order, the newest registered first
     * (handle_uretprobe_chain(), kernel/events/uprobes.c): that consumer's probe came
     * first at the entry and hooked first, so it is the last of done[]. */
    for (k = 0; k < n; k++) {
        probe *p;

        i = tramp != g_tramp ? n - 1 - k : k;
        p = done[i]->rp;
        if (p->kind == PK_KRET) {
            /* the harness runs the handler unless the kretprobe is gone (orphan) */
            uint32_t idx = (uint32_t)(done[i] - p->insts);

            round_trip(v, vcpu, EV_RET, p->addr, &p->id, 1, idx, real, slot, 0);
            v->regs[KREG_IP] = real;
        } else if (atomic_load(&g_live) && atomic_load(&p->enabled) && !atomic_load(&p->dead)) {
            /* what this instance saved (get_kretprobe_retaddr()): the trampoline when it
             * was stacked on another kretprobe of the same call; the harness prints the
             * kernel's own trampoline for it. uretprobes chain the real one instead
             * (prepare_uretprobe(): ri->chained). */
            emit(v, vcpu, p, REC_RET, p->addr, shown_ret(done, n, i, tramp, real), done[i]);
        }
    }
    if (uret_frame) {
        /* sys_uretprobe() writes r11, cx and, in ax's slot, the address the trampoline's
         * ret goes to (spec probes change no register) */
        uint64_t args[3] = {v->regs[KREG_R11], v->regs[KREG_CX], real};

        mem_write(v, v->regs[KREG_SP] - 24, args, sizeof(args));
    }
    pthread_mutex_lock(&rp_lock);
    for (i = 0; i < n; i++) {
        probe *p = done[i]->rp;
        p->freelist[p->nfree++] = done[i];
    }
    pthread_mutex_unlock(&rp_lock);
    qemu_plugin_set_pc(real);
}

/* ---------------------------------------------------------------- handler round trips */

static int read_full(int fd, void *buf, size_t len);
static int write_full(int fd, const void *buf, size_t len);

/* A command header from the harness. A handler usually answers within microseconds:
 * poll for a short while before sleeping in read(), which saves the wake-up of this
 * (vCPU) thread on the way back. */
#define SPIN_NS 40000
/* A handler that has not answered in this long is taken for a dead harness: the vCPU
 * goes on (a guest cannot wait forever on a host that hangs). */
#define HANDLER_TIMEOUT_MS 120000
static int read_cmd(int fd, uint32_t h[2])
{
    uint64_t t0 = now_ns();
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int r;

    do {
        ssize_t got = recv(fd, h, 8, MSG_DONTWAIT | MSG_PEEK);

        if (got == 8 || got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
            break;
        }
    } while (now_ns() - t0 < SPIN_NS);
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
static void chan_set(vcpu_t *v, int fd)
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
static int round_trip(vcpu_t *v, unsigned int vcpu, uint32_t type, uint64_t addr,
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

        if (read_cmd(fd, h) != 0) {
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

static void arm_post(unsigned int vcpu, vcpu_t *v, uint64_t addr)
{
    v->post_armed = 1;
    v->post_addr = addr;
    if (g_sb) {
        qemu_plugin_u64_set((qemu_plugin_u64){g_sb, 0}, vcpu, 1);
    }
}

static void disarm_post(unsigned int vcpu, vcpu_t *v)
{
    v->post_armed = 0;
    v->discon_pending = 0;
    if (g_sb) {
        qemu_plugin_u64_set((qemu_plugin_u64){g_sb, 0}, vcpu, 0);
    }
}

/* The instruction after a probed one is about to run: the post_handlers see the
 * registers after the probed instruction (kprobe_post_process(), 6.1). */
static void deliver_post(unsigned int vcpu, vcpu_t *v, uint64_t pc)
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

/* ---------------------------------------------------------------- callbacks */

static void on_site(unsigned int vcpu, void *ud)
{
    site *s = ud;
    vcpu_t *v = vc(vcpu);
    plist *l;
    int i, have = 0, running = -1;

    if (!v) {
        return;
    }
    service_invalidations(v);
    if (s->tramp) {
        on_trampoline(vcpu, v, s->addr);
        return;
    }
    if (!atomic_load_explicit(&g_live, memory_order_relaxed)) {
        return;
    }
    l = atomic_load_explicit(&s->list, memory_order_acquire);
    if (!l) {
        return;
    }
    if (v->post_armed && !atomic_load_explicit(&g_post_mode, memory_order_relaxed)) {
        disarm_post(vcpu, v);       /* its probe went, and post mode with it */
    }
    if (v->post_armed) {
        /* A probe hit while this vCPU is between a pre and its post_handler: the
         * kernel's reenter_kprobe() counts it missed (kprobes_inc_nmissed_count()). */
        uint32_t ids[MAX_PER_SITE], n = 0;

        for (i = 0; i < l->n; i++) {
            if (atomic_load(&l->p[i]->enabled) && !atomic_load(&l->p[i]->dead)) {
                atomic_fetch_add(&l->p[i]->nmissed, 1);
                if (l->p[i]->kind >= PK_KPROBE) {
                    ids[n++] = l->p[i]->id;
                }
            }
        }
        if (n) {
            read_context(v, s->addr);
            round_trip(v, vcpu, EV_MISS, s->addr, ids, n, 0, 0, 0, 0);
        }
        return;
    }
    /* Aggregate probes run newest first (add_new_kprobe() links at the head); a run of
     * Python kprobes is one round trip, and a pre_handler that returns non-zero ends the
     * chain (aggr_pre_handler()). */
    for (i = 0; i < l->n; i++) {
        probe *p = l->p[i];

        if (!atomic_load_explicit(&p->enabled, memory_order_relaxed) ||
            atomic_load_explicit(&p->dead, memory_order_relaxed)) {
            continue;
        }
        if (!have) {
            read_context(v, s->addr);
            if (p->flags & ADD_FTRACE) {
                /* arch/x86/kernel/ftrace_64.S, save_mcount_regs: movq $0, ORIG_RAX(%rsp) */
                v->regs[KREG_ORIG_AX] = 0;
            }
            have = 1;
        }
        if (!filter_ok(v, p)) {
            atomic_fetch_add_explicit(&g_n_filtered, 1, memory_order_relaxed);
            continue;               /* another program at this user address */
        }
        if ((p->flags & ADD_KPROBE_RUNNING) && guest_kprobe_running(v, &running)) {
            atomic_fetch_add(&p->nmissed, 1);
            continue;
        }
        if (p->kind == PK_SPEC_P) {
            atomic_fetch_add(&p->nhit, 1);
            emit(v, vcpu, p, REC_HIT, p->addr, 0, NULL);
        } else if (p->kind == PK_SPEC_R || p->kind == PK_KRET) {
            kret_entry(vcpu, v, p);
        } else if (p->kind == PK_FORK) {
            atomic_fetch_add(&p->nhit, 1);
            user_fork(v);
        } else if (p->kind == PK_FLUSH) {
            atomic_fetch_add(&p->nhit, 1);
            flush_task(v->regs[KREG_DI], 0);
        } else if (p->kind == PK_UFREE) {
            atomic_fetch_add(&p->nhit, 1);
            flush_task(v->regs[KREG_DI], 1);
        } else if (p->kind == PK_KPROBE) {
            uint32_t ids[MAX_PER_SITE];
            uint32_t n = 0;
            int act;

            /* each probe of the run has its own filter: Python uprobes of one user
             * address may target different processes */
            while (i < l->n && l->p[i]->kind == PK_KPROBE) {
                if (atomic_load(&l->p[i]->enabled) && !atomic_load(&l->p[i]->dead)) {
                    if (filter_ok(v, l->p[i])) {
                        ids[n++] = l->p[i]->id;
                        atomic_fetch_add(&l->p[i]->nhit, 1);
                    } else {
                        atomic_fetch_add_explicit(&g_n_filtered, 1, memory_order_relaxed);
                    }
                }
                i++;
            }
            i--;
            if (!n) {
                continue;
            }
            act = round_trip(v, vcpu, EV_PRE, s->addr, ids, n, 0, 0, 0, 0);
            if (act == ACT_SETPC) {
                /* the path was changed: no instruction, no post_handler */
                qemu_plugin_set_pc(v->new_ip);
            }
            if (act == ACT_POST) {
                arm_post(vcpu, v, s->addr);
            }
        }
    }
}

/* The next instruction of the same translation block after a probed one. */
static void on_after(unsigned int vcpu, void *ud)
{
    vcpu_t *v = vc(vcpu);
    site *s = ud;

    if (v && v->post_armed && !v->discon_pending && v->post_addr == s->addr) {
        atomic_fetch_add(&g_n_post_insn, 1);
        deliver_post(vcpu, v, s->addr + s->len);
    }
}

static void discon_post(unsigned int vcpu, vcpu_t *v, uint64_t entry);

/* The first instruction of any block, when this vCPU has a post pending (the probed
 * instruction ended its block: a branch, call, ret, or the block's size limit). */
static void on_tb_start(unsigned int vcpu, void *ud)
{
    vcpu_t *v = vc(vcpu);

    if (v && v->post_armed) {
        uint64_t pc = (uint64_t)(uintptr_t)ud;             /* the block's first address */

        if (v->discon_pending) {
            discon_post(vcpu, v, pc);
        } else {
            atomic_fetch_add(&g_n_post_tb, 1);
            deliver_post(vcpu, v, pc);
        }
    }
}

static int site_has_post(site *s)
{
    plist *l = atomic_load_explicit(&s->list, memory_order_acquire);
    int i;

    for (i = 0; l && i < l->n; i++) {
        if (l->p[i]->kind == PK_KPROBE && (l->p[i]->flags & ADD_POST)) {
            return 1;
        }
    }
    return 0;
}

static int site_needs_pc(site *s)
{
    plist *l = atomic_load_explicit(&s->list, memory_order_acquire);
    int i;

    for (i = 0; l && i < l->n; i++) {
        if (l->p[i]->kind == PK_KPROBE || l->p[i]->kind == PK_KRET) {
            return 1;
        }
    }
    return s->tramp;
}

static void on_tb_trans(struct qemu_plugin_tb *tb, void *ud)
{
    size_t n = qemu_plugin_tb_n_insns(tb), i;
    site *prev_post = NULL;

    (void)ud;
    if (atomic_load_explicit(&g_post_mode, memory_order_relaxed) && g_sb) {
        qemu_plugin_register_vcpu_tb_exec_cond_cb(tb, on_tb_start, QEMU_PLUGIN_CB_RW_REGS_PC,
                                                  QEMU_PLUGIN_COND_NE,
                                                  (qemu_plugin_u64){g_sb, 0}, 0,
                                                  (void *)(uintptr_t)qemu_plugin_tb_vaddr(tb));
    }
    for (i = 0; i < n; i++) {
        struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);
        uint64_t a = qemu_plugin_insn_vaddr(insn);
        site *s = site_find(a);
        plist *l;

        if (prev_post) {
            /* before this instruction's own probes: post of the one before comes first */
            qemu_plugin_register_vcpu_insn_exec_cb(insn, on_after, QEMU_PLUGIN_CB_RW_REGS_PC,
                                                   prev_post);
            prev_post = NULL;
        }
        if (!s) {
            continue;
        }
        l = atomic_load_explicit(&s->list, memory_order_acquire);
        if (s->tramp || (l && l->n)) {
            /* set_pc() and register writes need RW_REGS_PC; spec probes only read. */
            qemu_plugin_register_vcpu_insn_exec_cb(
                insn, on_site, site_needs_pc(s) ? QEMU_PLUGIN_CB_RW_REGS_PC : QEMU_PLUGIN_CB_R_REGS, s);
            if (site_has_post(s)) {
                s->len = (uint32_t)qemu_plugin_insn_size(insn);
                prev_post = s;
            }
        }
    }
}

/* An exception or interrupt while a post_handler is pending. On x86 QEMU calls the
 * discontinuity callback before it delivers the event (the registers are still those
 * of the interrupted code, and rip is that of the block's start), so it is only noted
 * here; the next block to start on this vCPU is the handler's entry, with the hardware
 * frame (rip, cs, rflags, rsp, ss, after an error code for some exceptions) pushed:
 * - an exception can only come from the probed instruction itself (the post is delivered
 *   before the next instruction): the harness runs the fault_handlers there, with the
 *   faulting registers from the frame and the vector from the entry point (1 =
 *   handled: frame undone, the vCPU resumes at regs.ip: the meaning the 2005 texts give
 *   kprobe::fault_handler, which 5.14 removed and harness/engines/gdbstub_engine.py keeps host-side),
 *   and no post_handler (the guest's own int3 there, vector 3, is the guest's);
 * - an interrupt came after the probed instruction completed: the post_handlers run with
 *   the registers it left, rip/rflags/rsp from the frame. */
static void discon_post(unsigned int vcpu, vcpu_t *v, uint64_t entry)
{
    uint64_t at = v->post_addr;
    int kind = v->discon_pending, act;

    disarm_post(vcpu, v);
    read_context(v, entry);
    if (kind == 2) {
        act = round_trip(v, vcpu, EV_FAULT, at, NULL, 0, 0, 0, entry, 0);
    } else {
        atomic_fetch_add(&g_n_post_irq, 1);
        act = round_trip(v, vcpu, EV_POST, at, NULL, 0, 1, 0, entry, 0);
    }
    if (act == ACT_SETPC || act == ACT_HANDLED) {
        qemu_plugin_set_pc(v->new_ip);
    }
}

static void on_discon(unsigned int vcpu, enum qemu_plugin_discon_type type, uint64_t from,
                      uint64_t to, void *ud)
{
    vcpu_t *v = vc(vcpu);

    (void)ud;
    if (!v) {
        return;
    }
    atomic_fetch_add_explicit(type == QEMU_PLUGIN_DISCON_INTERRUPT ? &g_n_irq : &g_n_exc, 1,
                              memory_order_relaxed);
    service_invalidations(v);
    if (v->post_armed && !v->discon_pending) {
        v->discon_pending = type == QEMU_PLUGIN_DISCON_INTERRUPT ? 1 : 2;
    }
}

static void on_idle(unsigned int vcpu, void *ud)
{
    vcpu_t *v = vc(vcpu);

    (void)ud;
    if (v) {
        service_invalidations(v);
        atomic_store(&v->idle, 1);
    }
}

static void on_resume(unsigned int vcpu, void *ud)
{
    vcpu_t *v = vc(vcpu);

    (void)ud;
    if (v) {
        atomic_store(&v->idle, 0);
        service_invalidations(v);
    }
}

static const char *const reg_names[KREG_NUM] = {
    "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx",
    "rsi", "rdi", NULL, "rip", "cs", "eflags", "rsp", "ss",
};

static void on_vcpu_init(unsigned int vcpu, void *ud)
{
    vcpu_t *v;

    (void)ud;
    if (vcpu >= MAX_VCPUS) {
        return;
    }
    v = calloc(1, sizeof(*v));
    if (!v) {
        say("kph_plugin: out of memory: a vCPU without probes\n");
        return;
    }
    v->gb = g_byte_array_new();     /* g_malloc: aborts rather than return NULL */
    atomic_store(&v->chan, -1);
    pthread_mutex_init(&v->chan_lock, NULL);
    if (!atomic_load(&g_regs_ready)) {
        GArray *regs = qemu_plugin_get_registers();
        unsigned int i, esz = regs ? g_array_get_element_size(regs) : 0;
        int k;

        for (i = 0; regs && i < regs->len; i++) {
            qemu_plugin_reg_descriptor *d = (void *)(regs->data + (size_t)i * esz);

            for (k = 0; k < KREG_NUM; k++) {
                if (reg_names[k] && !strcmp(d->name, reg_names[k])) {
                    g_reg[k] = d->handle;
                }
            }
            for (k = 0; k < NSYS; k++) {
                if (!strcmp(d->name, sys_names[k])) {
                    g_sys[k] = d->handle;
                }
            }
            if (!strcmp(d->name, "gs_base")) {
                g_gs_base = d->handle;
            } else if (!strcmp(d->name, "k_gs_base")) {
                g_kgs_base = d->handle;
            }
        }
        if (regs) {
            g_array_free(regs, 1);
        }
        atomic_store(&g_regs_ready, 1);
    }
    g_vcpu[vcpu] = v;
}

/* ---------------------------------------------------------------- full flush */

/* The other way to reach translated code: qemu_plugin_reset() drops every callback and
 * flushes the whole translation cache; the callbacks are registered again when it is
 * done. Kept to measure it against the one-byte write (bench/plugin_invalidation.py). */
static pthread_mutex_t reset_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t reset_cond = PTHREAD_COND_INITIALIZER;
static int reset_done_flag;

static void register_callbacks(void);

static void on_reset_done(void *ud)
{
    (void)ud;
    register_callbacks();
    /* every translation is gone: so are the invalidations that overflowed */
    pthread_mutex_lock(&inval_lock);
    if (inval_flush_upto > inval_done) {
        inval_done = inval_flush_upto;
        atomic_fetch_add(&inval_ns_total, now_ns() - inval_t0);
    }
    pthread_cond_broadcast(&inval_cond);
    pthread_mutex_unlock(&inval_lock);
    pthread_mutex_lock(&reset_lock);
    reset_done_flag = 1;
    pthread_cond_broadcast(&reset_cond);
    pthread_mutex_unlock(&reset_lock);
}

/* qemu_plugin_reset() flushes the translation cache only when called with a current
 * vCPU (plugin_reset_uninstall(), plugins/core.c: without one it just drops the
 * callbacks): so a vCPU calls it, at its next callback, like an invalidation. */

static void service_reset(void)
{
    int one = 1;

    if (atomic_load_explicit(&reset_wanted, memory_order_relaxed) &&
        atomic_compare_exchange_strong(&reset_wanted, &one, 0)) {
        atomic_fetch_add(&g_n_flush, 1);
        qemu_plugin_reset(g_id, on_reset_done, NULL);
    }
}

static int reset_all(int timeout_ms)
{
    struct timespec dl;
    int rc = INVAL_DONE;

    pthread_mutex_lock(&reset_lock);
    reset_done_flag = 0;
    pthread_mutex_unlock(&reset_lock);
    atomic_store(&reset_wanted, 1);
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += timeout_ms / 1000;
    pthread_mutex_lock(&reset_lock);
    while (!reset_done_flag) {
        struct timespec step, t;

        if (all_idle()) {
            /* the first vCPU to leave idle resets before it runs anything */
            rc = INVAL_IDLE;
            break;
        }
        clock_gettime(CLOCK_REALTIME, &step);
        step.tv_nsec += 2000000L;
        if (step.tv_nsec >= 1000000000L) {
            step.tv_sec++;
            step.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&reset_cond, &reset_lock, &step);
        clock_gettime(CLOCK_REALTIME, &t);
        if (!reset_done_flag && (t.tv_sec > dl.tv_sec || (t.tv_sec == dl.tv_sec && t.tv_nsec >= dl.tv_nsec))) {
            rc = INVAL_PENDING;
            break;
        }
    }
    pthread_mutex_unlock(&reset_lock);
    return rc;
}

/* ---------------------------------------------------------------- control channel */

static int read_full(int fd, void *buf, size_t len)
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

static int write_full(int fd, const void *buf, size_t len)
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
    uint64_t addr;
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
        {
            size_t k;
            uint8_t j;

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
                    if (p->nsave >= 8 || p->prog[k].imm > 255) {
                        probe_free(p);
                        return reply(fd, EINVAL, NULL, 0);
                    }
                    p->save[p->nsave++] = (uint8_t)p->prog[k].imm;
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
        if (!p->insts || !p->freelist) {
            probe_free(p);
            return reply(fd, ENOMEM, NULL, 0);
        }
        for (i = 0; i < maxactive; i++) {
            p->insts[i].rp = p;
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
         * (the current process may not map it); flush everything instead. */
        st = (uint32_t)reset_all(5000);
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

static int serve(int fd)
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
             * [, u64 this_cpu_off's per-cpu offset[, u64 current_kprobe's]]] */
            if (len != 40 && len != 56 && len != 64 && len != 72) {
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
            /* u32 vcpu, one descriptor: that vCPU's handler channel */
            uint32_t i32 = 0;
            vcpu_t *v;

            if (len >= 4) {
                memcpy(&i32, pl, 4);
            }
            v = vc(i32);
            if (!v || rfd < 0) {
                if (rfd >= 0) {
                    close(rfd);
                }
                rc = reply(fd, EINVAL, NULL, 0);
                break;
            }
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
        default:
            rc = reply(fd, ENOSYS, NULL, 0);
        }
        free(pl);
        if (rc != 0) {
            return -1;
        }
    }
}

static void *ctl_thread(void *arg)
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

static void register_callbacks(void)
{
    qemu_plugin_register_vcpu_tb_trans_cb(g_id, on_tb_trans, NULL);
    qemu_plugin_register_vcpu_discon_cb(g_id, QEMU_PLUGIN_DISCON_INTERRUPT | QEMU_PLUGIN_DISCON_EXCEPTION,
                                        on_discon, NULL);
    qemu_plugin_register_vcpu_idle_cb(g_id, on_idle, NULL);
    qemu_plugin_register_vcpu_resume_cb(g_id, on_resume, NULL);
}

KPH_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc,
                                   char **argv)
{
    pthread_t th;
    sigset_t all, old;
    int i;

    g_id = id;
    if (!info->system_emulation || strcmp(info->target_name, "x86_64") != 0) {
        say("kph_plugin: needs qemu-system-x86_64\n");
        return -1;
    }
    g_nvcpus = info->system.max_vcpus;
    if (g_nvcpus > MAX_VCPUS) {
        say("kph_plugin: too many vCPUs\n");
        return -1;
    }
    for (i = 0; i < argc; i++) {
        if (!strncmp(argv[i], "ctl=", 4)) {
            g_ctl_fd = atoi(argv[i] + 4);
        }
    }
    if (g_ctl_fd < 0) {
        say("kph_plugin: no ctl=FD argument\n");
        return -1;
    }
    qemu_plugin_register_vcpu_init_cb(id, on_vcpu_init, NULL);
    register_callbacks();
    /* The control thread takes no signal meant for QEMU's own threads. */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    i = pthread_create(&th, NULL, ctl_thread, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (i != 0) {
        say("kph_plugin: cannot start the control thread\n");
        return -1;
    }
    pthread_detach(th);
    return 0;
}
