/*
 * kph fetch programs: capture the memory a probe's fetch args read (see fetch.h).
 *
 * The control flow is process_fetch_insn() of kernel/trace/trace_kprobe.c (Linux 6.1)
 * with process_fetch_insn_bottom() of kernel/trace/trace_probe_tmpl.h, stage by stage,
 * as harness/kernel/grammar/fetch.py _run() follows it. Where the kernel stores a value, this only
 * keeps what was read; the harness then evaluates the same program over the reads.
 * Strings are captured up to their NUL or MAX_STRING_SIZE bytes, page by page, so both
 * of the kernel's passes (sizing, then store) find what they read.
 */
#include <string.h>

#include "fetch.h"

static void *blk_alloc(kph_capture *c, uint64_t addr, uint32_t len, uint16_t kind)
{
    uint32_t dlen = kind == KBLK_FAULT ? 0 : len;   /* a fault has a range, no bytes */
    size_t need = 16 + ((dlen + 7u) & ~7u);
    uint8_t *p;

    if (c->len + need > c->cap) {
        c->truncated = 1;
        return NULL;
    }
    p = c->buf + c->len;
    memcpy(p, &addr, 8);
    memcpy(p + 8, &len, 4);
    memcpy(p + 12, &kind, 2);
    memset(p + 14, 0, 2);
    if (need > 16 + dlen) {
        memset(p + 16 + dlen, 0, need - 16 - dlen);
    }
    c->len += need;
    c->nblocks++;
    return p + 16;
}

/* Read len bytes at addr into the record; 0 and the value in *out (if len <= 8) or -1. */
static int cap_read(kph_capture *c, uint64_t addr, uint32_t len, uint64_t *out)
{
    uint8_t tmp[64];
    void *dst;

    if (len == 0 || len > sizeof(tmp)) {
        return -1;
    }
    if (c->read(c->read_ctx, addr, tmp, len) != 0) {
        blk_alloc(c, addr, len, KBLK_FAULT);
        return -1;
    }
    dst = blk_alloc(c, addr, len, KBLK_DATA);
    if (dst) {
        memcpy(dst, tmp, len);
    }
    if (out) {
        *out = 0;
        memcpy(out, tmp, len > 8 ? 8 : len);
    }
    return 0;
}

/* A NUL-terminated string at addr: read in pieces that never cross a page, until the
 * NUL, MAX_STRING_SIZE bytes, or a page that does not read (then a fault block). */
static void cap_string(kph_capture *c, uint64_t addr)
{
    uint8_t piece[256];
    size_t got = 0, start_len = c->len;
    uint32_t nb = c->nblocks;
    int done = 0, limit = 0;

    /* The block header first; its length is patched when the string is complete. */
    if (!blk_alloc(c, addr, 0, KBLK_STR)) {
        return;
    }
    while (!done) {
        uint64_t a = addr + got;
        size_t room = 4096 - (a & 4095);
        size_t want = sizeof(piece) < room ? sizeof(piece) : room;
        size_t i;

        if (got + want > KPH_MAX_STRING) {
            want = KPH_MAX_STRING - got;
        }
        if (want == 0) {
            limit = 1;
            break;
        }
        if (c->read(c->read_ctx, a, piece, want) != 0) {
            break;          /* a piece fails only when its whole page does not read */
        }
        for (i = 0; i < want; i++) {
            if (piece[i] == 0) {
                want = i + 1;
                done = 1;
                break;
            }
        }
        if (c->len + want + 8 > c->cap) {
            c->truncated = 1;
            break;
        }
        memcpy(c->buf + c->len, piece, want);
        c->len += want;
        got += want;
    }
    /* Patch the header: length and kind, then pad to 8. */
    {
        uint8_t *hdr = c->buf + start_len;
        uint32_t len32 = (uint32_t)got;
        uint16_t kind = limit ? KBLK_STR_LIMIT : KBLK_STR;
        size_t pad = (8 - (got & 7)) & 7;

        memcpy(hdr + 8, &len32, 4);
        memcpy(hdr + 12, &kind, 2);
        if (c->len + pad > c->cap) {
            c->truncated = 1;
            c->len = start_len;
            c->nblocks = nb;
            return;
        }
        memset(c->buf + c->len, 0, pad);
        c->len += pad;
    }
    if (!done && !limit && !c->truncated) {
        blk_alloc(c, addr + got, (uint32_t)(4096 - ((addr + got) & 4095)), KBLK_FAULT);
    }
}

/* regs_get_kernel_stack_nth(): 0 outside the current THREAD_SIZE stack (no read). */
static uint64_t stack_nth(kph_capture *c, const uint64_t *regs, uint64_t n)
{
    uint64_t sp = regs[KREG_SP], addr = sp + 8 * n, v = 0;

    if ((addr & ~(uint64_t)(KPH_THREAD_SIZE - 1)) != (sp & ~(uint64_t)(KPH_THREAD_SIZE - 1))) {
        return 0;
    }
    if (cap_read(c, addr, 8, &v) != 0) {
        return 0;
    }
    return v;
}

static int is_string(uint8_t op)
{
    return op == KOP_ST_STRING || op == KOP_ST_USTRING || op == KOP_ST_SYMSTR ||
           op == KOP_ST_STRING_UPROBE;
}

static int is_store(uint8_t op)
{
    return is_string(op) || op == KOP_ST_RAW || op == KOP_ST_MEM || op == KOP_ST_UMEM;
}

static const uint8_t arg_regs[6] = {KREG_DI, KREG_SI, KREG_DX, KREG_CX, KREG_R8, KREG_R9};

/* Every stage-1 operation run_one() takes a register from, and nothing else reads one
 * (the later stages work on the value). An immediate string's bytes may follow its
 * KOP_DATA and read as operations here: they can only add registers, never drop one. */
uint32_t kph_prog_regs(const kph_insn *prog, size_t n)
{
    uint32_t m = 1u << KREG_SP | 1u << KREG_CS | 1u << KREG_IP;
    size_t k;
    int i;

    for (k = 0; k < n; k++) {
        switch (prog[k].op) {
        case KOP_REG:
            m |= prog[k].a < KREG_NUM ? 1u << prog[k].a : KREG_ALL;
            break;
        case KOP_RETVAL:
            m |= 1u << KREG_AX;
            break;
        case KOP_ARG:
            for (i = 0; i < 6; i++) {
                m |= 1u << arg_regs[i];
            }
            break;
        case KOP_TP_ARG:
            m |= 1u << KREG_DI;
            break;
        default:            /* %sp's (KOP_STACK, KOP_STACKP, KOP_USTACK), or none */
            break;
        }
    }
    return m;
}

/* One argument's program, code[0..end); returns 0 (the harness judges the outcome). */
static int run_one(kph_capture *c, const kph_insn *code, size_t end, const uint64_t *regs)
{
    uint64_t val = 0, lval, count_done = 0;
    size_t pc, s3;
    int blob = 0;

    if (end < 2) {
        return -1;
    }
    switch (code[0].op) {   /* stage 1 */
    case KOP_REG:
        if (code[0].a >= KREG_NUM) {
            return -1;
        }
        val = regs[code[0].a];
        break;
    case KOP_STACK:
        val = stack_nth(c, regs, code[0].imm);
        break;
    case KOP_STACKP:
        val = regs[KREG_SP];
        break;
    case KOP_RETVAL:
        val = regs[KREG_AX];
        break;
    case KOP_IMM:
    case KOP_FOFFS:
        val = code[0].imm;
        break;
    case KOP_COMM:
    case KOP_DATA:
        blob = 1;       /* current->comm or an immediate string: nothing to read */
        break;
    case KOP_USTACK:
        if (cap_read(c, regs[KREG_SP] + 8 * code[0].imm, 8, &val) != 0) {
            val = 0;
        }
        break;
    case KOP_ARG:
        val = code[0].imm < 6 ? regs[arg_regs[code[0].imm]] : stack_nth(c, regs, code[0].imm - 5);
        break;
    case KOP_TP_ARG: {
        /* get_event_field() (kernel/trace/trace_eprobe.c, 6.12 and 7.3) on the record
         * trace_event_buffer_commit() was given: fbuffer->entry, then the field */
        uint64_t rec = 0, addr, raw = 0;
        uint32_t size = code[0].b & 0xff;

        if (cap_read(c, regs[KREG_DI] + code[0].pad, 8, &rec) != 0) {
            return 0;
        }
        addr = rec + code[0].imm;
        switch (code[0].a) {
        case KTP_STATIC:
            val = addr;
            break;
        case KTP_DYN:
        case KTP_RDYN:
        case KTP_RDYN4:
            if (cap_read(c, addr, 4, &raw) != 0) {
                return 0;
            }
            val = (code[0].a == KTP_DYN ? rec : code[0].a == KTP_RDYN ? addr : addr + 4) +
                  (raw & 0xffff);
            break;
        case KTP_PTR:
            if (cap_read(c, addr, 8, &val) != 0) {
                return 0;
            }
            break;
        default:
            if (size != 1 && size != 2 && size != 4) {
                size = 8;
            }
            if (cap_read(c, addr, size, &raw) != 0) {
                return 0;
            }
            if ((code[0].b >> 8) & 1 && size < 8 && (raw >> (8 * size - 1)) & 1) {
                raw |= ~0ULL << (8 * size);
            }
            val = raw;
        }
        break;
    }
    case KOP_CURRENT:
        val = c->task;
        break;
    case KOP_EDATA: {
        /* FETCH_OP_EDATA: the entry handler's store_trace_entry_data() */
        uint32_t i;
        uint8_t *dst;

        for (i = 0; i < c->nedata && c->edata_idx[i] != code[0].imm; i++) {
        }
        if (i >= c->nedata) {
            return -1;      /* the probe did not save it: a malformed program */
        }
        val = c->edata[i];
        dst = blk_alloc(c, code[0].imm, 8, KBLK_EDATA);
        if (dst) {
            memcpy(dst, &val, 8);
        }
        break;
    }
    default:
        return -1;
    }
    pc = 1;
    lval = val;
    for (;;) {
        while (pc < end && (code[pc].op == KOP_DEREF || code[pc].op == KOP_UDEREF ||
                            code[pc].op == KOP_CPU_PTR)) {                          /* stage 2 */
            if (code[pc].op == KOP_CPU_PTR) {
                uint8_t *dst;

                if (!c->has_percpu || blob) {
                    return 0;
                }
                dst = blk_alloc(c, 0, 8, KBLK_PERCPU);
                if (dst) {
                    memcpy(dst, &c->percpu, 8);
                }
                val += c->percpu;
                pc++;
                continue;
            }
            lval = val;
            if (blob || cap_read(c, val + code[pc].imm, 8, &val) != 0) {
                return 0;
            }
            pc++;
        }
        s3 = pc;
        for (;;) {
            uint8_t op;

            if (pc >= end) {
                return -1;
            }
            op = code[pc].op;                                                       /* stage 3 */
            if (!is_store(op)) {
                return 0;
            }
            if (!blob) {
                uint64_t addr = val + code[pc].imm;

                if (op == KOP_ST_STRING || op == KOP_ST_USTRING || op == KOP_ST_STRING_UPROBE) {
                    cap_string(c, addr);
                } else if (op == KOP_ST_MEM || op == KOP_ST_UMEM) {
                    cap_read(c, addr, code[pc].b, NULL);
                }
            }
            if (pc + 1 < end && code[pc + 1].op == KOP_MOD_BF) {                    /* stage 4 */
                pc++;
            }
            pc++;
            if (pc >= end || code[pc].op != KOP_LP_ARRAY) {                         /* stage 5 */
                return 0;
            }
            if (code[pc].b == 0 || code[pc].b > KPH_MAX_ARRAY_LEN) {
                return -1;          /* a count the kernel never accepts */
            }
            if (++count_done >= code[pc].b) {
                return 0;
            }
            pc = s3;
            if (code[s3].op != KOP_ST_STRING && code[s3].op != KOP_ST_USTRING &&
                code[s3].op != KOP_ST_STRING_UPROBE) {
                val += code[s3].b;
                continue;
            }
            if (s3 == 0) {
                return -1;
            }
            pc = s3 - 1;            /* the next char * in the array */
            val = lval + 8;
            break;
        }
        if (code[pc].op != KOP_DEREF && code[pc].op != KOP_UDEREF) {
            return 0;               /* only reachable for a malformed program */
        }
    }
}

int kph_capture_args(kph_capture *c, const kph_insn *prog, size_t n, const uint64_t regs[KREG_NUM])
{
    size_t i = 0, nargs = 0;

    while (i < n) {
        size_t end = i;

        while (end < n && prog[end].op != KOP_END) {
            end++;
        }
        if (end >= n) {
            return -1;
        }
        /* end points at KOP_END: the program is code[i..end], END included. */
        if (run_one(c, prog + i, end - i + 1, regs) < 0) {
            return -1;
        }
        nargs++;
        i = end + 1;
    }
    return (int)nargs;
}

int kph_check_prog(const kph_insn *prog, size_t n)
{
    size_t i;

    for (i = 0; i < n; i++) {
        if (prog[i].op == KOP_LP_ARRAY && (prog[i].b == 0 || prog[i].b > KPH_MAX_ARRAY_LEN)) {
            return -1;
        }
    }
    return 0;
}
