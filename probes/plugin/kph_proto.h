/*
 * kph_proto.h: the wire protocol between the kph plugin (kph_plugin.c) and the harness
 * (harness/machine/pluginlink.py), in one place: command and probe kinds, flags, limits
 * the harness must respect, and the layouts of the ring's record header and of a handler
 * event. The Python side spells the same names; tests/unit/test_plugin_build.py compiles
 * a program against this header and compares every constant, offset and size with
 * Python's, so the two cannot drift apart.
 *
 * Every count or index the harness sends is bounded by the plugin against these limits
 * (a request past one is EINVAL, or ENOSPC with a KPH_FULL_* reason as its reply payload).
 */
#ifndef KPH_PROTO_H
#define KPH_PROTO_H

#include <stdint.h>

#define KPH_PROTO 2

/* limits */
#define KPH_MAX_VCPUS 64
#define KPH_MAX_PROBES 8192         /* live probes in all */
#define KPH_MAX_PER_SITE 64         /* live probes at one address (CMD_ADD: ENOSPC past it) */
#define KPH_MAX_PROG 1024           /* kph_insn per probe */
#define KPH_MAX_MAXACTIVE 4096      /* instances of one return probe */
#define KPH_MAX_EDATA 128           /* $argN one return probe saves (MAX_TRACE_ARGS) */
#define KPH_REC_MAX (64 * 1024)     /* bytes of one record */
#define KPH_ANSWER_SPIN_US 40       /* CMD_CHANNEL's default answer_spin_us */

/* requests: u32 type, u32 len, payload; replies: u32 status (0 or an errno), u32 len, payload */
enum {
    CMD_HELLO = 1, CMD_RING = 2, CMD_CONFIG = 3, CMD_ADD = 4, CMD_REMOVE = 5, CMD_ENABLE = 6,
    CMD_STATS = 7, CMD_GSTATS = 8, CMD_INVALIDATE = 9, CMD_CHANNEL = 10, CMD_ARRANGE = 11,
    /* CMD_CHANNEL: u32 vcpu [, u32 answer_spin_us], one descriptor: that vCPU's handler
     * channel, and how long the vCPU polls it for each answer before it sleeps
     * (KPH_ANSWER_SPIN_US when not given) */
    /* tests only: u64 addr, u64 len; the plugin's reads of those bytes fail although the
     * page maps (an unconfirmed fault: the harness must not take it for the guest's) */
    CMD_FAILREAD = 12,
    /* the recording window: u32 on, u32 nwrites (<= KPH_MAX_WIN_WRITES), then per write
     * u64 addr, u32 size (1, 2, 4 or 8), u32 pad, u64 set, u64 clear; spec probes record
     * only while the window is open, and the guest's own switch (its tracing_on, the
     * module's recording flag: value = (value & ~clear) | set) is written at the same
     * instant, at a point no vCPU is between a hit and the guest's handler of it (a vCPU
     * entering or leaving idle). u32 reply: WIN_* */
    CMD_WINDOW = 13,
    /* the 8-byte words that the last opening and the last closing of the window read at
     * their instant (CMD_WINDOW's reads: after the writes, u32 nreads (<=
     * KPH_MAX_WIN_READS), then u64 addr each; read before the writes are made). Reply, for
     * the opening then the closing: u32 state (KPH_MARKS_*), u32 n, then n u64 values */
    CMD_MARKS = 14,
};
#define KPH_MAX_WIN_WRITES 4
#define KPH_MAX_WIN_READS 256
/* CMD_MARKS: a direction's words were read in its last switch (READ), the switch is still
 * to be applied (PENDING: an idle guest applies it as a vCPU leaves idle), no switch of
 * that direction asked for reads since the session began (NONE), or a read failed */
enum { KPH_MARKS_READ = 0, KPH_MARKS_PENDING = 1, KPH_MARKS_NONE = 2, KPH_MARKS_FAILED = 3 };
/* CMD_WINDOW's reply: applied when a vCPU entered or left idle (SETTLED); every vCPU idle,
 * so the first to leave idle applies it before it runs anything (IDLE); no vCPU idled in
 * time and the next callback of any kind applied it (UNSETTLED: a hit in flight there is
 * seen by one side only); not applied in time (PENDING: applied later, as UNSETTLED);
 * a guest write failed (FAILED: the window switched, the guest's switch did not) */
enum { WIN_SETTLED = 0, WIN_IDLE = 1, WIN_UNSETTLED = 2, WIN_PENDING = 3, WIN_FAILED = 4 };
/* CMD_ADD refused with ENOSPC: which limit (u32 reply payload) */
enum { KPH_FULL_SITE = 1, KPH_FULL_PROBES = 2, KPH_FULL_TABLE = 3 };
/* CMD_CONFIG flags: the kernel's 64-bit uretprobe trampoline pushes rax, rcx and r11
 * (6.11+, arch/x86/kernel/uprobes.c: uretprobe_trampoline_entry) */
#define CFG_URET_SYSCALL 1u
/* CMD_CONFIG flags, bits 8-15: where preempt_count()'s 4 hardirq bits start (its NMI bits
 * follow): include/linux/preempt.h HARDIRQ_SHIFT, 16 up to 6.x (0 here means 16), 24 in 7.3 */
#define CFG_HARDIRQ_SHIFT(f) ((((f) >> 8) & 0xffu) ? (unsigned)(((f) >> 8) & 0xffu) : 16u)
/* CMD_GSTATS: u64 counters, in this order (plugin_engine.py names them) */
#define KPH_NGSTATS 17

enum { PK_SPEC_P = 1, PK_SPEC_R = 2, PK_KPROBE = 3, PK_KRET = 4,
       /* at uprobe_copy_process(t, flags): a fork child gets copies of the parent
        * task's user return instances (dup_utask()) */
       PK_FORK = 5,
       /* at rethook_flush_task(tk): the kernel return instances of a dead task go back
        * to their pools (delayed_put_task_struct(), kernel/exit.c, 6.1 to 7.3) */
       PK_FLUSH = 6,
       /* at uprobe_free_utask(t): the user return instances of a task that exits or
        * execs are freed (mm_release(), kernel/fork.c, 6.1 to 7.3) */
       PK_UFREE = 7 };

/* CMD_ADD's u32 flags */
enum { ADD_ENABLED = 1, ADD_NO_INVALIDATE = 2, ADD_POST = 4, ADD_ENTRY = 8, ADD_EXT = 16,
       ADD_FLUSH = 32,
       /* an ftrace site (the harness decides, as check_ftrace_location() does): the
        * regs a kprobe there sees are ftrace_regs_caller's, with orig_ax 0 */
       ADD_FTRACE = 64,
       /* a return probe whose kernel counterpart hooks the return through the function
        * graph (7.3's fprobe exits: return_to_handler), not rethook */
       ADD_FGRAPH = 128,
       /* an fprobe (an ftrace_ops callback, not a kprobe): with rethook (6.12) its exit
        * handler is given the real return address, stacked or not
        * (rethook_trampoline_handler()); through the function graph (ADD_FGRAPH, 7.3)
        * what the slot held when it hooked (fprobe_return()) */
       ADD_FTRACE_OPS = 256,
       /* a Python return probe with no entry round trip: a uretprobe, whose consumers
        * have no entry_handler (the harness builds the instance at the return) */
       ADD_NO_ENTRY_RT = 512,
       /* a kprobe of the guest's kind: a hit while one of the guest's own kprobe handlers
        * runs on that CPU (per-cpu current_kprobe set, CMD_CONFIG) is missed, as
        * kprobe_int3_handler() / kprobe_ftrace_handler() count it (kernel/kprobes.c,
        * arch/x86/kernel/kprobes/{core,ftrace}.c, 6.1 to 7.3) */
       ADD_KPROBE_RUNNING = 1024 };
#define ADD_EXT_SIZE 64             /* u64 tramp, u32 nfilter, u32 pad, u64 filter[4], u64 expect,
                                     * u64 direct map (page_offset_base; 0: unknown) */

/* handler round trips on a vCPU's channel: events to the harness, its commands back */
enum { EV_PRE = 1, EV_POST = 2, EV_FAULT = 3, EV_RET_ENTRY = 4, EV_RET = 5, EV_MISS = 6 };
enum { C_READ = 1, C_WRITE = 2, C_READREG = 3, C_DONE = 4 };
enum { ACT_CONTINUE = 0, ACT_SETPC = 1, ACT_POST = 2, ACT_DISCARD = 3, ACT_HANDLED = 4 };

/* records in the rings */
enum { REC_HIT = 1, REC_RET = 2, REC_PAD = 3, REC_ERROR = 4 };
/* record flags: RF_UNCONFIRMED, a read of the program failed where the page translates
 * (a failure of the plugin's read, not the guest's fault: the harness fails the hit) */
enum { RF_TRUNC = 1, RF_TASK = 2, RF_PID = 4, RF_COMM = 8, RF_BADPROG = 16,
       RF_UNCONFIRMED = 32,
       /* the caller's context: RF_CTX when its preempt_count() was read (CMD_CONFIG's
        * per-cpu offset), then what it held: in_serving_softirq(), hardirq_count(), in_nmi()
        * (include/linux/preempt.h); the harness decides irq or task as the guest's trace
        * entry does (harness.kernel.kprobes.preempt_context) */
       RF_CTX = 64, RF_SOFTIRQ = 128, RF_HARDIRQ = 256, RF_NMI = 512,
       /* a kernel hit where nmi_uaccess_okay() is false (arch/x86/mm/tlb.c): current->mm
        * is not cpu_tlbstate.loaded_mm, so copy_from_user_nofault() refuses (CMD_CONFIG's
        * two uaccess offsets; never set without them) */
       RF_NOUACCESS = 1024 };
enum { INVAL_DONE = 0, INVAL_IDLE = 1, INVAL_PENDING = 2, INVAL_SKIPPED = 3 };

/* the ring: a header page, per-vCPU control blocks, per-vCPU data areas */
#define RING_MAGIC 0x4b504852u      /* "RHPK" */
#define RING_CTL_OFF 4096
#define RING_CTL_SIZE 128

/* A record's header (then its captured blocks, fetch.h); 8-byte aligned, little endian. */
typedef struct {
    uint32_t size;                  /* of the whole record, a multiple of 8 */
    uint16_t type;                  /* REC_* */
    uint16_t vcpu;
    uint32_t probe_id;
    uint32_t nblocks;
    uint64_t seq;
    uint64_t regs[21];              /* struct pt_regs order (fetch.h KREG_*); a spec
                                     * probe's: those kph_prog_regs() names, others 0 */
    uint64_t task;
    uint64_t func;
    uint64_t ret_addr;
    int32_t pid;
    uint32_t flags;                 /* RF_* */
    char comm[16];
} kph_rec_hdr;
#define REC_HDR 240

/* A handler event's header; ids[4] are its first probe ids, more follow it. */
typedef struct {
    uint32_t type;                  /* EV_* */
    uint32_t vcpu;
    uint32_t n;                     /* probe ids */
    uint32_t extra;
    uint64_t addr;
    uint64_t regs[21];
    uint64_t task;
    int32_t pid;
    uint32_t tflags;
    char comm[16];
    uint64_t a, b;
    uint32_t ids[4];
} kph_ev_hdr;
#define EV_HDR 256

_Static_assert(sizeof(kph_rec_hdr) == REC_HDR, "record header");
_Static_assert(sizeof(kph_ev_hdr) == EV_HDR, "event header");

#endif
