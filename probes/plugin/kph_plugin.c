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
 * bounded before use (control.c).
 *
 * The parts share the lock-free site table, the per-vCPU state and the callback contexts
 * QEMU allows (set_pc only where registered with RW_REGS_PC, memory writes only from a
 * vCPU), declared in kph_plugin.h. This file: site table, invalidation, registers and
 * memory, ring, callbacks (where a hit is handled, post and fault delivery, translation),
 * full flush, install; returns.c: kretprobes and uretprobes (instances, the trampoline,
 * fork, exit); roundtrip.c: handler round trips; control.c: the control channel.
 * fetch.c (the fetch programs) has no QEMU in it and is tested on its own.
 */
#include "kph_plugin.h"

KPH_EXPORT int qemu_plugin_version = KPH_QEMU_PLUGIN_API;

static qemu_plugin_id_t g_id;
int g_nvcpus;
vcpu_t *g_vcpu[MAX_VCPUS];
atomic_int g_live;           /* a harness is connected and probes may fire */
int g_ctl_fd = -1;
pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;   /* control-side changes */
static _Atomic(site *) g_table[TABLE_SIZE];
probe *g_probes[MAX_PROBES];
int g_nprobes;               /* slots used; removed probes' slots are reused */
uint64_t g_born;
uint64_t g_tramp;
site *g_tramp_site;
uint64_t g_cur_task_off, g_pid_off, g_comm_off;
uint64_t g_this_cpu_off;     /* per-cpu offset of this_cpu_off (CMD_CONFIG) */
uint64_t g_mm_off;           /* task_struct.mm, once a user return probe exists */
/* CMD_CONFIG flags (kph_proto.h): CFG_URET_SYSCALL, the kernel's 64-bit uretprobe trampoline
 * pushes rax, rcx and r11 and calls sys_uretprobe() (6.11+, arch/x86/kernel/uprobes.c) */
_Atomic uint64_t g_cfg_flags;
/* CMD_CONFIG's eighth word: the per-cpu address of current_kprobe (kprobe_running()) */
_Atomic uint64_t g_current_kprobe;
uint64_t g_preempt_off;      /* per-cpu offset of preempt_count() (CMD_CONFIG), 0: none */
/* task_struct.mm and cpu_tlbstate.loaded_mm's per-cpu offset (CMD_CONFIG), 0: none */
uint64_t g_uacc_mm_off, g_loaded_mm_off;
/* CMD_CONFIG's optional tail: what the guest kernel writes in a return-address slot it
 * hooks (arch_rethook_trampoline; return_to_handler for ADD_FGRAPH probes), which a
 * program reading a slot the plugin hooked sees instead of the plugin's trampoline */
_Atomic uint64_t g_ktramp_rethook, g_ktramp_fgraph;
atomic_uint_fast64_t g_seq;
atomic_uint_fast64_t g_tramp_missing;
atomic_uint_fast64_t g_tramp_overflow;   /* instances past MAX_PER_SLOT at one return */
atomic_uint_fast64_t g_kret_flushed;     /* instances of dead tasks (rethook_flush_task) */
atomic_uint_fast64_t g_uret_freed;       /* user ones at exit or exec (uprobe_free_utask) */
atomic_uint_fast64_t g_uret_inherited;   /* fork children's inherited user slots */
atomic_uint_fast64_t g_uret_forked;      /* user return instances copied at a fork */
/* counts for GSTATS: discontinuities seen (interrupts, exceptions), posts delivered by
 * path (next instruction, next block, interrupt), full flushes */
atomic_uint_fast64_t g_n_irq, g_n_exc, g_n_post_insn, g_n_post_tb, g_n_post_irq, g_n_flush;
atomic_uint_fast64_t g_n_filtered;   /* uprobe hits of another program */

/* registers, by pt_regs index, and the two GS bases */
struct qemu_plugin_register *g_reg[KREG_NUM];
struct qemu_plugin_register *g_gs_base, *g_kgs_base;
/* system registers a handler may read (regs.read_sys), by index (NSYS: kph_plugin.h) */
static const char *const sys_names[NSYS] = {
    "cr0", "cr2", "cr3", "cr4", "cr8", "efer", "fs_base", "gs_base", "k_gs_base",
};
struct qemu_plugin_register *g_sys[NSYS];
/* post_handlers: once one exists, every translation block starts with a conditional
 * callback that fires on a vCPU whose scoreboard entry says a post is pending */
atomic_int g_post_mode;
atomic_int g_n_post;         /* live probes with a post or fault handler */
int g_post_off;              /* control thread: the last one went */
struct qemu_plugin_scoreboard *g_sb;
atomic_int g_regs_ready;
/* A session's ring; a new session's replaces it and the old mapping is kept (a callback
 * may still be writing into it), so nothing is ever unmapped under a vCPU. */
_Atomic(ring_t *) g_ring;

/* kretprobes */
pthread_mutex_t rp_lock = PTHREAD_MUTEX_INITIALIZER;
inst *g_live_tab[LIVE_SIZE];

/* invalidation */
static pthread_mutex_t inval_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t inval_cond = PTHREAD_COND_INITIALIZER;
static uint64_t inval_addr[MAX_PENDING];
static uint8_t inval_must[MAX_PENDING];   /* an address that must map (else: full flush) */
static int inval_n;
static int inval_overflow;          /* more than MAX_PENDING: a full flush serves them all */
static uint64_t inval_flush_upto;   /* the requests the next full flush completes */
static atomic_int inval_pending;
static uint64_t inval_requested, inval_done;
atomic_uint_fast64_t inval_count, inval_ns_total;
static uint64_t inval_t0;

uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + ts.tv_nsec;
}

void say(const char *fmt, ...)
{
    char buf[256];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    qemu_plugin_outs(buf);
}

vcpu_t *vc(unsigned int i)
{
    return i < MAX_VCPUS ? g_vcpu[i] : NULL;
}

/* ---------------------------------------------------------------- site table */

static unsigned int slot_of(uint64_t addr)
{
    return (unsigned int)((addr * 0x9E3779B97F4A7C15ull) >> 50) & (TABLE_SIZE - 1);
}

site *site_find(uint64_t addr)
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
site *site_get(uint64_t addr)
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
int site_set(site *s, probe **ps, int n)
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

/* User code has no one virtual address to write through: a program's page is mapped at
 * its address in each process that runs it, and code translated there is keyed by the
 * physical page (QEMU's translations are). So every user block translated since the last
 * full flush notes its virtual page and the physical page behind it (the first
 * instruction's and the last's), and a user probe invalidates each physical page noted at
 * its address, through the kernel's direct map (page_offset_base + physical: mapped in
 * every context where no PTI splits the page tables; a read that fails there flushes
 * everything instead). What was never translated needs nothing: a translation made from
 * now on sees the site (it notes its page before it looks the site up, and the adder
 * publishes the site before it reads the notes, both under umap_lock). A table full, or a
 * page that did not translate, falls back to the full flush. */
static void request_invalidate_as(uint64_t addr, uint8_t must);
#define UMAP_SIZE 4096              /* a power of two; filled to 3/4 at most */
_Atomic uint64_t g_direct_map;
static pthread_mutex_t umap_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t umap_v[UMAP_SIZE], umap_p[UMAP_SIZE];  /* virtual page | 1, physical page */
static int umap_n, umap_overflow;

static void umap_note(uint64_t vpage, uint64_t ppage)
{
    uint64_t key = vpage | 1, i = ((vpage >> 12) * 0x9E3779B97F4A7C15ull ^ (ppage >> 12)) & (UMAP_SIZE - 1);

    for (;; i = (i + 1) & (UMAP_SIZE - 1)) {
        if (!umap_v[i]) {
            if (umap_n >= UMAP_SIZE / 4 * 3) {
                umap_overflow = 1;
                return;
            }
            umap_v[i] = key;
            umap_p[i] = ppage;
            umap_n++;
            return;
        }
        if (umap_v[i] == key && umap_p[i] == ppage) {
            return;
        }
    }
}

/* Translation (vCPU): note the user pages of a block, before its sites are looked up. */
static void umap_tb(struct qemu_plugin_tb *tb, size_t n)
{
    uint64_t first = qemu_plugin_tb_vaddr(tb), last, pages[2], hw;
    struct qemu_plugin_insn *end;
    int k;

    if (!n || (int64_t)first < 0) {
        return;                     /* kernel code (the upper half, with 4 or 5 levels of
                                     * page tables): its addresses are written through */
    }
    end = qemu_plugin_tb_get_insn(tb, n - 1);
    last = qemu_plugin_insn_vaddr(end) + qemu_plugin_insn_size(end) - 1;
    pages[0] = first & ~0xfffull;
    pages[1] = last & ~0xfffull;
    pthread_mutex_lock(&umap_lock);
    for (k = 0; k < (pages[1] != pages[0] ? 2 : 1); k++) {
        if (qemu_plugin_translate_vaddr(pages[k], &hw)) {
            umap_note(pages[k], hw & ~0xfffull);
        } else {
            umap_overflow = 1;      /* it translated a moment ago: be safe */
        }
    }
    pthread_mutex_unlock(&umap_lock);
}

/* A full flush is starting (from a vCPU): what was noted goes with it. */
static void umap_clear(void)
{
    pthread_mutex_lock(&umap_lock);
    memset(umap_v, 0, sizeof(umap_v));
    umap_n = 0;
    umap_overflow = 0;
    pthread_mutex_unlock(&umap_lock);
}

/* Control thread, after the sites at `vaddrs` were published: invalidate what was
 * translated at them, or flush everything when that cannot be known. Returns an INVAL_*
 * state as wait_invalidated() does. */
int user_invalidate(const uint64_t *vaddrs, int n)
{
    uint64_t dm = atomic_load(&g_direct_map), addrs[64];
    int i, k, m = 0, full = !dm;

    pthread_mutex_lock(&umap_lock);
    full |= umap_overflow;
    for (i = 0; !full && i < UMAP_SIZE; i++) {
        for (k = 0; umap_v[i] && k < n; k++) {
            if (umap_v[i] == ((vaddrs[k] & ~0xfffull) | 1)) {
                if (m == 64) {
                    full = 1;
                    break;
                }
                addrs[m++] = dm + umap_p[i] + (vaddrs[k] & 0xfff);
            }
        }
    }
    pthread_mutex_unlock(&umap_lock);
    if (full) {
        return reset_all(5000);
    }
    if (!m) {
        return INVAL_DONE;          /* never translated: nothing holds the old code */
    }
    for (i = 0; i < m; i++) {
        request_invalidate_as(addrs[i], 1);
    }
    return wait_invalidated(2000);
}

static void request_invalidate_as(uint64_t addr, uint8_t must)
{
    pthread_mutex_lock(&inval_lock);
    if (inval_n < MAX_PENDING) {
        inval_must[inval_n] = must;
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

void request_invalidate(uint64_t addr)
{
    request_invalidate_as(addr, 0);
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
    uint8_t must[MAX_PENDING];
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
    memcpy(must, inval_must, n);
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
        uint64_t a = addrs[i];

        g_byte_array_set_size(v->gb, 0);
        if (qemu_plugin_read_memory_vaddr(a, v->gb, 1)) {
            qemu_plugin_write_memory_vaddr(a, v->gb);
        } else if (must[i]) {
            /* a user page's direct-map address that does not map here (PTI): the
             * whole cache goes instead, and these requests are done with it */
            pthread_mutex_lock(&inval_lock);
            if (upto > inval_flush_upto) {
                inval_flush_upto = upto;
            }
            pthread_mutex_unlock(&inval_lock);
            atomic_store(&reset_wanted, 1);
            service_reset();
            return;
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
int wait_invalidated(int timeout_ms)
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

uint64_t reg_read(vcpu_t *v, struct qemu_plugin_register *h)
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
_Atomic uint64_t g_fail_lo, g_fail_hi;
atomic_uint_fast64_t g_n_unconfirmed;

int read_once(vcpu_t *v, uint64_t addr, void *buf, size_t len)
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
int mem_read(void *ctx, uint64_t addr, void *buf, size_t len)
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
/* nmi_uaccess_okay() (arch/x86/mm/tlb.c) at this kernel hit: current->mm is the
 * per-cpu cpu_tlbstate.loaded_mm. 1: yes or not known, 2: no (a task past exit_mm(), a
 * kernel thread on a borrowed mm): copy_from_user_nofault() refuses a plain user-half
 * read then, and the harness's fetch does too (RF_NOUACCESS). */
static int uaccess_state(vcpu_t *v)
{
    uint64_t mm, loaded;

    if (!g_uacc_mm_off || !g_loaded_mm_off || !(v->tflags & RF_TASK) ||
        (v->regs[KREG_CS] & 3) != 0) {
        return 1;
    }
    if (mem_read(v, v->task + g_uacc_mm_off, &mm, 8) != 0 ||
        mem_read(v, reg_read(v, g_gs_base) + g_loaded_mm_off, &loaded, 8) != 0) {
        return 1;
    }
    return mm == loaded ? 1 : 2;
}

static int prog_read(void *ctx, uint64_t addr, void *buf, size_t len)
{
    uint64_t s, val;
    inst *ri;
    vcpu_t *v = ctx;

    if (addr < 0x800000000000ull && !v->uaccess) {
        v->uaccess = uaccess_state(v);  /* once a hit, where it can matter only */
    }
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

int mem_write(vcpu_t *v, uint64_t addr, const void *buf, size_t len)
{
    g_byte_array_set_size(v->gb, len);
    memcpy(v->gb->data, buf, len);
    return qemu_plugin_write_memory_vaddr(addr, v->gb) ? 0 : -1;
}

/* Two members of one object, [base + a, +alen) and [base + b, +blen), read at once
 * where they lie within PAIR_MAX bytes of each other. QEMU walks the guest's page tables
 * for every read (cpu_memory_rw_debug()), and a hit reads two such pairs: preempt_count
 * and current_task, a task's pid and comm (read_context(): 0.94 us a hit in four reads,
 * 0.62 in two; the registers' 21 reads 0.65). 0: both read. -1: not read (too far
 * apart, or the read failed): the caller reads each alone, so a failure still says
 * which one failed. */
#define PAIR_MAX 1024
static int read_pair(vcpu_t *v, uint64_t base, uint64_t a, void *abuf, size_t alen,
                     uint64_t b, void *bbuf, size_t blen)
{
    uint8_t buf[PAIR_MAX];
    uint64_t lo = a < b ? a : b, hi = a + alen > b + blen ? a + alen : b + blen;

    if (hi - lo > PAIR_MAX || read_once(v, base + lo, buf, hi - lo) != 0) {
        return -1;
    }
    memcpy(abuf, buf + (a - lo), alen);
    memcpy(bbuf, buf + (b - lo), blen);
    return 0;
}

/* The pt_regs of this hit, and `current` with its pid and comm (read through the
 * per-cpu current_task at the kernel's GS base: in user mode that base waits in
 * MSR_KERNEL_GS_BASE until swapgs).
 *
 * `pc` is where the vCPU is: in an instruction callback TCG has not stored rip for
 * instructions past the block's first, so the caller says (from translation time);
 * 0 means rip is current (discontinuity callbacks). The same goes for the arithmetic
 * flags, which TCG computes lazily and the plugin API cannot reach: in an instruction
 * callback `flags` holds IF and the other system bits, not ZF/SF/CF/... (README).
 *
 * `regs`: the registers to read (a bit per KREG_*), the others 0: a spec probe's hit
 * reads what its programs read (kph_prog_regs(); 21 reads took 0.65 us a hit), a
 * Python handler's every one. */
void read_context_regs(vcpu_t *v, uint64_t pc, uint32_t regs)
{
    int i, task_read = 0;
    uint64_t base, pid_off;

    for (i = 0; i < KREG_NUM; i++) {
        if (!(regs & 1u << i)) {
            v->regs[i] = 0;
        } else if (i != KREG_IP || !pc) {
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
    base = reg_read(v, (v->regs[KREG_CS] & 3) == 3 ? g_kgs_base : g_gs_base);
    if (g_preempt_off) {
        uint32_t pc;
        int got;

        /* the low 32 bits (7.3's x86 preempt_count is an unsigned long): SOFTIRQ at 8,
         * HARDIRQ at HARDIRQ_SHIFT, NMI after it (CFG_HARDIRQ_SHIFT) */
        unsigned shift = CFG_HARDIRQ_SHIFT(atomic_load(&g_cfg_flags));

        /* 16 to 64 bytes apart on 6.1, 6.12 and 7.3 (struct pcpu_hot since 6.2) */
        if (g_cur_task_off &&
            read_pair(v, base, g_preempt_off, &pc, 4, g_cur_task_off, &v->task, 8) == 0) {
            got = task_read = 1;
        } else {
            got = mem_read(v, base + g_preempt_off, &pc, 4) == 0;
        }
        if (got) {
            v->tflags |= RF_CTX | (pc & 0x100 ? RF_SOFTIRQ : 0) |
                         (pc & (0xFu << shift) ? RF_HARDIRQ : 0) |
                         (pc & (0xFu << (shift + 4)) ? RF_NMI : 0);
        }
    }
    if (!g_cur_task_off) {
        return;
    }
    if (!task_read && mem_read(v, base + g_cur_task_off, &v->task, 8) != 0) {
        return;
    }
    v->tflags |= RF_TASK;
    pid_off = g_pid_off;
    if (pid_off && g_comm_off &&
        read_pair(v, v->task, pid_off, &v->pid, 4, g_comm_off, v->comm, 16) == 0) {
        v->tflags |= RF_PID | RF_COMM;
        return;
    }
    if (pid_off && mem_read(v, v->task + pid_off, &v->pid, 4) == 0) {
        v->tflags |= RF_PID;
    }
    if (g_comm_off && mem_read(v, v->task + g_comm_off, v->comm, 16) == 0) {
        v->tflags |= RF_COMM;
    }
}

void read_context(vcpu_t *v, uint64_t pc)
{
    read_context_regs(v, pc, KREG_ALL);
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
void emit(vcpu_t *v, unsigned int vcpu, probe *p, uint16_t type, uint64_t func,
          uint64_t ret_addr, const inst *ri)
{
    kph_capture cap = {
        .buf = v->rec + REC_HDR, .cap = REC_MAX - REC_HDR, .read = prog_read, .read_ctx = v,
        .task = v->task,
    };
    uint32_t size;

    if (!atomic_load_explicit(&g_window, memory_order_relaxed)) {
        return;                     /* the recording window is closed (CMD_WINDOW) */
    }
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

    v->uaccess = 0;                 /* judged at the program's first user-half read */
    if (p->nprog && kph_capture_args(&cap, p->prog, p->nprog, v->regs) < 0) {
        flags |= RF_BADPROG;
    }
    if (v->uaccess == 2) {
        flags |= RF_NOUACCESS;
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

/* ---------------------------------------------------------------- the recording window */

/* Spec probes record only while the window is open (CMD_WINDOW; open by default and at
 * every new session). The harness opens and closes it together with the guest's own
 * switch, as tracing_on gates the guest's ring buffer while its kprobes stay armed
 * (kernel/trace/trace.c: tracer_tracing_on()/_off(); a kprobe's handler still runs and
 * counts): both sides then record over the same instructions. The switch is applied by
 * a vCPU (guest memory is written only from a vCPU) where none is between a hit and the
 * guest's handler of it: as a vCPU enters or leaves idle. */
atomic_int g_window = 1;
static pthread_mutex_t win_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t win_cond = PTHREAD_COND_INITIALIZER;
static atomic_int win_pending;      /* a switch waits for a vCPU */
static atomic_int win_force;        /* ... at its next callback of any kind */
static int win_on, win_nw, win_status;
static uint64_t win_req, win_done;
static struct {
    uint64_t addr, set, clear;
    uint32_t size;
} win_w[MAX_WIN_WRITES];
/* the words a switch reads at its instant (the guest's counters at the window's edges),
 * and what the last opening [1] and closing [0] read */
static int win_nr;
static uint64_t win_r[MAX_WIN_READS];
static uint64_t win_vals[2][MAX_WIN_READS];
static uint32_t win_nvals[2], win_state[2] = {KPH_MARKS_NONE, KPH_MARKS_NONE};

/* vCPU: apply a pending switch, if this is a point it may be applied at. */
static void service_window(vcpu_t *v, int settled)
{
    int i, failed = 0;

    if (!atomic_load_explicit(&win_pending, memory_order_acquire)) {
        return;
    }
    if (!settled && !atomic_load_explicit(&win_force, memory_order_relaxed)) {
        return;
    }
    if (pthread_mutex_trylock(&win_lock) != 0) {
        return;
    }
    if (atomic_load(&win_pending)) {
        if (win_nr > 0) {
            int bad = 0;

            for (i = 0; i < win_nr; i++) {
                win_vals[win_on][i] = 0;
                if (mem_read(v, win_r[i], &win_vals[win_on][i], 8) != 0) {
                    bad = 1;
                }
            }
            win_nvals[win_on] = (uint32_t)win_nr;
            win_state[win_on] = bad ? KPH_MARKS_FAILED : KPH_MARKS_READ;
        }
        for (i = 0; i < win_nw; i++) {
            uint64_t x = 0;

            if (mem_read(v, win_w[i].addr, &x, win_w[i].size) != 0) {
                failed = 1;
                continue;
            }
            x = (x & ~win_w[i].clear) | win_w[i].set;
            if (mem_write(v, win_w[i].addr, &x, win_w[i].size) != 0) {
                failed = 1;
            }
        }
        atomic_store(&g_window, win_on);
        win_status = failed ? WIN_FAILED : settled ? WIN_SETTLED : WIN_UNSETTLED;
        win_done = win_req;
        atomic_store(&win_pending, 0);
        atomic_store(&win_force, 0);
        pthread_cond_broadcast(&win_cond);
    }
    pthread_mutex_unlock(&win_lock);
}

static void win_deadline(struct timespec *dl, int ms)
{
    clock_gettime(CLOCK_REALTIME, dl);
    dl->tv_sec += ms / 1000;
    dl->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (dl->tv_nsec >= 1000000000L) {
        dl->tv_sec++;
        dl->tv_nsec -= 1000000000L;
    }
}

/* Control thread: CMD_WINDOW. `now`: switch at once, no guest write (and drop a switch
 * still pending); else wait up to `settle_ms` for a vCPU to apply it where it settles,
 * then up to as long again at any callback. Returns a WIN_* status. */
int window_switch(int on, int now, int nw, const uint8_t *w, int nr, const uint8_t *r,
                  int settle_ms)
{
    struct timespec dl;
    uint64_t want;
    int i, rc, forced = 0;

    pthread_mutex_lock(&win_lock);
    if (now) {
        atomic_store(&win_pending, 0);
        atomic_store(&win_force, 0);
        atomic_store(&g_window, on);
        win_state[0] = win_state[1] = KPH_MARKS_NONE;
        pthread_mutex_unlock(&win_lock);
        return WIN_SETTLED;
    }
    for (i = 0; i < nw; i++) {
        memcpy(&win_w[i].addr, w + 32 * i, 8);
        memcpy(&win_w[i].size, w + 32 * i + 8, 4);
        memcpy(&win_w[i].set, w + 32 * i + 16, 8);
        memcpy(&win_w[i].clear, w + 32 * i + 24, 8);
    }
    win_nw = nw;
    win_nr = nr;
    for (i = 0; i < nr; i++) {
        memcpy(&win_r[i], r + 8 * i, 8);
    }
    win_on = on;
    if (nr > 0) {
        win_state[on] = KPH_MARKS_PENDING;
    }
    want = ++win_req;
    atomic_store(&win_force, 0);
    atomic_store_explicit(&win_pending, 1, memory_order_release);
    win_deadline(&dl, settle_ms);
    for (;;) {
        if (win_done >= want) {
            rc = win_status;
            break;
        }
        /* an idle vCPU runs nothing before it leaves idle, and applies it then */
        if (!forced && all_idle()) {
            rc = WIN_IDLE;
            break;
        }
        if (pthread_cond_timedwait(&win_cond, &win_lock, &dl) == ETIMEDOUT &&
            win_done < want) {
            if (forced) {
                rc = WIN_PENDING;
                break;
            }
            forced = 1;
            atomic_store(&win_force, 1);
            win_deadline(&dl, settle_ms);
        }
    }
    pthread_mutex_unlock(&win_lock);
    return rc;
}

size_t window_marks(uint8_t *out)
{
    size_t n = 0;
    int d;

    pthread_mutex_lock(&win_lock);
    for (d = 1; d >= 0; d--) {         /* the opening first */
        uint32_t cnt = win_state[d] == KPH_MARKS_NONE ? 0 : win_nvals[d];

        memcpy(out + n, &win_state[d], 4);
        memcpy(out + n + 4, &cnt, 4);
        memcpy(out + n + 8, win_vals[d], 8 * (size_t)cnt);
        n += 8 + 8 * (size_t)cnt;
    }
    pthread_mutex_unlock(&win_lock);
    return n;
}

/* ---------------------------------------------------------------- callbacks */

static void on_site(unsigned int vcpu, void *ud)
{
    site *s = ud;
    vcpu_t *v = vc(vcpu);
    plist *l;
    int i, have = 0, running = -1;
    uint32_t want = 0, need;

    if (!v) {
        return;
    }
    service_invalidations(v);
    service_window(v, 0);
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
                count_miss(l->p[i]);
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
    /* the registers the site's hits read: a spec probe's programs', any other's all */
    for (i = 0; i < l->n; i++) {
        if (atomic_load_explicit(&l->p[i]->enabled, memory_order_relaxed) &&
            !atomic_load_explicit(&l->p[i]->dead, memory_order_relaxed)) {
            want |= l->p[i]->kind == PK_SPEC_P ? l->p[i]->regs : KREG_ALL;
        }
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
        /* a probe enabled since `want` was taken may need more: then all, read again */
        need = p->kind == PK_SPEC_P ? p->regs : KREG_ALL;
        if (!have || (need & ~want)) {
            want = have ? KREG_ALL : want | need | 1u << KREG_IP;
            read_context_regs(v, s->addr, want);
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
            count_miss(p);
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
    umap_tb(tb, n);
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
    service_window(v, 0);
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
        service_window(v, 1);
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
        service_window(v, 1);
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
    atomic_store(&v->answer_spin_ns, KPH_ANSWER_SPIN_US * 1000ull);
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
        umap_clear();
        qemu_plugin_reset(g_id, on_reset_done, NULL);
    }
}

int reset_all(int timeout_ms)
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
