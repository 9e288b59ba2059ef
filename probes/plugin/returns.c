/*
 * kph plugin: return probes (kph_plugin.h). Kretprobes as kernel/kprobes.c and
 * kernel/trace/rethook.c run them: an instance per call from a pool of maxactive
 * (pre_handler_kretprobe()), the return slot hooked, the trampoline's handlers newest first
 * (rethook_trampoline_handler()); a dead task's instances recycled (rethook_flush_task()).
 * Uretprobes as kernel/events/uprobes.c: instances keyed by (mm, slot), copied to a fork
 * child (dup_utask()), freed at exit and exec (uprobe_free_utask()).
 */
#include "kph_plugin.h"

/* ---------------------------------------------------------------- kretprobes */

unsigned int live_bucket(uint64_t slot)
{
    return (unsigned int)((slot >> 3) * 0x9E3779B97F4A7C15ull >> 52) & (LIVE_SIZE - 1);
}

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
int filter_ok(vcpu_t *v, probe *p)
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
    uint32_t i;

    for (i = 0; i < p->nsave; i++) {
        uint32_t n = p->save[i];
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
void kret_entry(unsigned int vcpu, vcpu_t *v, probe *p)
{
    uint64_t slot = v->regs[KREG_SP], ret;
    inst *ri;
    unsigned int b;

    pthread_mutex_lock(&rp_lock);
    if (p->nfree == 0) {
        pthread_mutex_unlock(&rp_lock);
        count_miss(p);
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
        count_miss(p);
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
void user_fork(vcpu_t *v)
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
            count_miss(p);
            continue;
        }
        c = p->freelist[--p->nfree];
        if (p->nsave) {
            memcpy(c->edata, from[i]->edata, p->nsave * sizeof(*c->edata));
        }
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
void flush_task(uint64_t task, int user)
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
int guest_kprobe_running(vcpu_t *v, int *cache)
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
void on_trampoline(unsigned int vcpu, vcpu_t *v, uint64_t tramp)
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
