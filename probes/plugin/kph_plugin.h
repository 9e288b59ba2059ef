/*
 * kph_plugin.h: what the parts of the kph plugin share (internal; the wire protocol is
 * kph_proto.h). kph_plugin.c: the site table, invalidation, registers and memory, the
 * ring, the callbacks, the full flush and the install; returns.c: kretprobes and
 * uretprobes (instances, the trampoline, fork and exit); roundtrip.c: handler round
 * trips on a vCPU's channel; control.c: the control channel (commands).
 */
#ifndef KPH_PLUGIN_H
#define KPH_PLUGIN_H

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
#include "kph_proto.h"

#define MAX_VCPUS KPH_MAX_VCPUS
#define TABLE_SIZE 16384            /* power of two; sites are never removed */
#define MAX_PROBES KPH_MAX_PROBES
#define MAX_PER_SITE KPH_MAX_PER_SITE
#define MAX_WIN_WRITES KPH_MAX_WIN_WRITES
#define MAX_WIN_READS KPH_MAX_WIN_READS
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
    uint32_t regs;      /* a spec probe's: the registers its hit reads (kph_prog_regs()) */
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
    /* a return probe's $argN (KOP_EDATA): the arguments its entry saves (0-based), in
     * first-use order (__store_entry_arg(): one for each, up to the line's
     * MAX_TRACE_ARGS arguments); its instances' saved values are edata_pool, nsave each;
     * its program adds the per-cpu offset (KOP_CPU_PTR) */
    uint32_t nsave, *save;
    uint64_t *edata_pool;
    int uses_percpu;
} probe;

typedef struct inst {
    probe *rp;
    uint64_t slot, ret_addr, task;
    uint64_t mm;                    /* user return probes: the address space of the slot */
    uint64_t *edata;                /* the arguments the entry saved (probe.save): nsave */
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
    _Atomic uint64_t answer_spin_ns; /* a round trip polls this long for each answer */
    int in_rt;
    int unconfirmed;                /* reads that failed where the page translates */
    int uaccess;                    /* this record's nmi_uaccess_okay(): 0 not asked, 1, 2 */
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


/* the ring */
typedef struct {
    uint8_t *base;
    uint64_t size;                  /* per vCPU, power of two */
    uint64_t data_off;
    int n;
} ring_t;

/* system registers a handler may read (regs.read_sys), by index */
#define NSYS 9

/* shared state (defined in kph_plugin.c unless said) */
extern int g_nvcpus;
extern vcpu_t *g_vcpu[MAX_VCPUS];
extern atomic_int g_live;
extern int g_ctl_fd;
extern pthread_mutex_t g_lock;
extern probe *g_probes[MAX_PROBES];
extern int g_nprobes;
extern uint64_t g_born;
extern uint64_t g_tramp;
extern site *g_tramp_site;
extern uint64_t g_cur_task_off, g_pid_off, g_comm_off;
extern uint64_t g_this_cpu_off;
extern uint64_t g_mm_off;
extern _Atomic uint64_t g_cfg_flags;
extern _Atomic uint64_t g_current_kprobe;
extern uint64_t g_preempt_off;
extern uint64_t g_uacc_mm_off, g_loaded_mm_off;
extern _Atomic uint64_t g_ktramp_rethook, g_ktramp_fgraph;
extern atomic_uint_fast64_t g_seq;
extern atomic_uint_fast64_t g_tramp_missing;
extern atomic_uint_fast64_t g_tramp_overflow;
extern atomic_uint_fast64_t g_kret_flushed;
extern atomic_uint_fast64_t g_uret_freed;
extern atomic_uint_fast64_t g_uret_inherited;
extern atomic_uint_fast64_t g_uret_forked;
extern atomic_uint_fast64_t g_n_irq, g_n_exc, g_n_post_insn, g_n_post_tb, g_n_post_irq, g_n_flush;
extern atomic_uint_fast64_t g_n_filtered;
extern struct qemu_plugin_register *g_reg[KREG_NUM];
extern struct qemu_plugin_register *g_gs_base, *g_kgs_base;
extern struct qemu_plugin_register *g_sys[NSYS];
extern atomic_int g_post_mode;
extern atomic_int g_n_post;
extern int g_post_off;
extern struct qemu_plugin_scoreboard *g_sb;
extern atomic_int g_regs_ready;
extern _Atomic(ring_t *) g_ring;
extern pthread_mutex_t rp_lock;
extern inst *g_live_tab[LIVE_SIZE];
extern atomic_uint_fast64_t inval_count, inval_ns_total;
extern _Atomic uint64_t g_fail_lo, g_fail_hi;
extern atomic_uint_fast64_t g_n_unconfirmed;

/* kph_plugin.c */
uint64_t now_ns(void);
void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
vcpu_t *vc(unsigned int i);
site *site_find(uint64_t addr);
site *site_get(uint64_t addr);
int site_set(site *s, probe **ps, int n);
void request_invalidate(uint64_t addr);
int wait_invalidated(int timeout_ms);
uint64_t reg_read(vcpu_t *v, struct qemu_plugin_register *h);
int read_once(vcpu_t *v, uint64_t addr, void *buf, size_t len);
int mem_read(void *ctx, uint64_t addr, void *buf, size_t len);
int mem_write(vcpu_t *v, uint64_t addr, const void *buf, size_t len);
void read_context(vcpu_t *v, uint64_t pc);
void read_context_regs(vcpu_t *v, uint64_t pc, uint32_t regs);
void emit(vcpu_t *v, unsigned int vcpu, probe *p, uint16_t type, uint64_t func, uint64_t ret_addr, const inst *ri);
int reset_all(int timeout_ms);
/* user code: translations of a user address reached without a full flush (kph_plugin.c) */
extern _Atomic uint64_t g_direct_map;
int user_invalidate(const uint64_t *vaddrs, int n);
int window_switch(int on, int now, int nw, const uint8_t *w, int nr, const uint8_t *r,
                  int settle_ms);
/* CMD_MARKS's reply payload into out (at most 16 + 16 * MAX_WIN_READS bytes); its length */
size_t window_marks(uint8_t *out);
extern atomic_int g_window;

/* A miss (kprobes_inc_nmissed_count(), rp->nmissed), counted while the recording window
 * is open: a run compares the guest's nmissed over the same window (its counters read at
 * the switch's instant), as it does nhit. Open by default: outside a run, every miss. */
static inline void count_miss(probe *p)
{
    if (atomic_load_explicit(&g_window, memory_order_relaxed)) {
        atomic_fetch_add(&p->nmissed, 1);
    }
}

/* returns.c */
unsigned int live_bucket(uint64_t slot);
int filter_ok(vcpu_t *v, probe *p);
void kret_entry(unsigned int vcpu, vcpu_t *v, probe *p);
void user_fork(vcpu_t *v);
void flush_task(uint64_t task, int user);
int guest_kprobe_running(vcpu_t *v, int *cache);
void on_trampoline(unsigned int vcpu, vcpu_t *v, uint64_t tramp);

/* roundtrip.c */
void chan_set(vcpu_t *v, int fd);
int round_trip(vcpu_t *v, unsigned int vcpu, uint32_t type, uint64_t addr, const uint32_t *ids, uint32_t n, uint32_t extra, uint64_t a, uint64_t b, int ip_by_register);
void arm_post(unsigned int vcpu, vcpu_t *v, uint64_t addr);
void disarm_post(unsigned int vcpu, vcpu_t *v);
void deliver_post(unsigned int vcpu, vcpu_t *v, uint64_t pc);

/* control.c */
int read_full(int fd, void *buf, size_t len);
int write_full(int fd, const void *buf, size_t len);
int serve(int fd);
void *ctl_thread(void *arg);

#endif
