/*
 * kph fetch programs: what the plugin captures at a spec probe's hit.
 *
 * A probe's fetch args arrive compiled by harness/kernel/grammar/program.py: the kernel's fetch_insn
 * list of each argument (kernel/trace/trace_probe.h, as harness/kernel/grammar/kprobe.py builds it),
 * one 16-byte kph_insn per instruction, each argument ending in KOP_END. The plugin
 * does not format anything: it runs each program the way process_fetch_insn()
 * (kernel/trace/trace_kprobe.c, Linux 6.1) walks it and keeps every memory read it makes,
 * bytes or fault, in the record. The harness then runs harness.kernel.grammar.fetch.evaluate() over
 * exactly those reads, so values, strings and faults come out of the same code as the
 * gdbstub engine's, and the guest memory was read at the hit, by the vCPU that hit.
 *
 * Layout of a captured block (8-byte aligned):
 *   u64 addr; u32 len; u16 kind (KBLK_*); u16 pad; u8 data[len] (KBLK_DATA, KBLK_STR*)
 */
#ifndef KPH_FETCH_H
#define KPH_FETCH_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint8_t op;
    uint8_t a;          /* register index (KREG_*) */
    uint16_t pad;
    uint32_t b;         /* size, count */
    uint64_t imm;       /* offset, immediate, n */
} kph_insn;

enum {
    KOP_END = 0,
    /* stage 1: where the value comes from */
    KOP_REG = 1, KOP_STACK, KOP_STACKP, KOP_RETVAL, KOP_IMM, KOP_COMM, KOP_DATA, KOP_ARG,
    KOP_USTACK, KOP_FOFFS,
    /* an event probe's field (FETCH_OP_TP_ARG) at trace_event_buffer_commit(fbuffer): the
     * record is *(%di + pad) (fbuffer->entry), the field at imm; a = KTP_* (how
     * get_event_field() reads it), b = size | signed << 8 */
    KOP_TP_ARG,
    /* $current (7.3, FETCH_OP_CURRENT): the task; $argN of a return probe (6.12+,
     * FETCH_OP_EDATA): what the entry saved of argument imm */
    KOP_CURRENT, KOP_EDATA,
    /* stage 2: dereferences */
    KOP_DEREF = 16, KOP_UDEREF,
    /* this_cpu_ptr() (7.3, FETCH_OP_CPU_PTR): plus this CPU's per-cpu offset */
    KOP_CPU_PTR,
    /* stage 3: stores */
    KOP_ST_RAW = 32, KOP_ST_MEM, KOP_ST_UMEM, KOP_ST_STRING, KOP_ST_USTRING, KOP_ST_SYMSTR,
    KOP_ST_STRING_UPROBE,
    /* stages 4 and 5 */
    KOP_MOD_BF = 48, KOP_LP_ARRAY,
};

/* struct pt_regs order (arch/x86/include/asm/ptrace.h): the record's register array. */
enum {
    KREG_R15, KREG_R14, KREG_R13, KREG_R12, KREG_BP, KREG_BX, KREG_R11, KREG_R10, KREG_R9,
    KREG_R8, KREG_AX, KREG_CX, KREG_DX, KREG_SI, KREG_DI, KREG_ORIG_AX, KREG_IP, KREG_CS,
    KREG_FLAGS, KREG_SP, KREG_SS, KREG_NUM
};
#define KREG_ALL ((1u << KREG_NUM) - 1)

/* trace_eprobe.c: get_event_field(), by the field's filter_type */
enum { KTP_INT = 0, KTP_DYN, KTP_RDYN, KTP_STATIC, KTP_PTR,
       KTP_RDYN4 /* a __rel_loc as an event filter reads it: filter_pred_strrelloc() */ };

/* KBLK_EDATA: an entry-saved argument a program used (addr: its number, 8 bytes);
 * KBLK_PERCPU: the per-cpu offset a program added (addr 0, 8 bytes) */
enum { KBLK_DATA = 1, KBLK_FAULT = 2, KBLK_STR = 3, KBLK_STR_LIMIT = 4, KBLK_EDATA = 5,
       KBLK_PERCPU = 6 };

#define KPH_MAX_STRING 4096      /* MAX_STRING_SIZE = PATH_MAX (trace_probe.h) */
#define KPH_MAX_ARRAY_LEN 64     /* MAX_ARRAY_LEN (trace_probe.h): "Array number is too big" */
#define KPH_THREAD_SIZE 16384    /* x86_64 without KASAN */

/* Read guest virtual memory; 0 on success, -1 when any byte cannot be read. */
typedef int (*kph_read_fn)(void *ctx, uint64_t addr, void *buf, size_t len);

typedef struct {
    uint8_t *buf;       /* where blocks go */
    size_t cap, len;
    uint32_t nblocks;
    int truncated;      /* a block did not fit */
    kph_read_fn read;
    void *read_ctx;
    /* the hit's context: current, this CPU's per-cpu offset (has_percpu), and a return
     * hit's entry-saved arguments (edata[i] is argument edata_idx[i]) */
    uint64_t task, percpu;
    int has_percpu;
    const uint64_t *edata;
    const uint32_t *edata_idx;
    uint32_t nedata;
} kph_capture;

/* Run every argument program in prog[0..n) against regs; append the reads to cap.
 * Returns the number of arguments run, or -1 for a malformed program. */
int kph_capture_args(kph_capture *cap, const kph_insn *prog, size_t n,
                     const uint64_t regs[KREG_NUM]);

/* The registers (a bit per KREG_*) the programs prog[0..n) read, with %sp and %cs, which
 * every hit reads (the stack's bounds, the task's gs base), and %ip (given by the site):
 * what a spec probe's hit needs read (read_context_regs()). Never fewer than a program
 * reads; an instruction it cannot place counts as reading every register. */
uint32_t kph_prog_regs(const kph_insn *prog, size_t n);

/* 0 when every array count in prog[0..n) is one the kernel accepts (1..MAX_ARRAY_LEN,
 * parse_probe_arg() in kernel/trace/trace_probe.c), else -1: the plugin refuses the probe. */
int kph_check_prog(const kph_insn *prog, size_t n);

#endif
