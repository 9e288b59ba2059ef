// SPDX-License-Identifier: GPL-2.0
/*
 * kph_kprobes: real kprobes and kretprobes placed from a control file, their hits
 * recorded for kprobe-harness (harness/backends/module.py reads them back).
 *
 * debugfs, /sys/kernel/debug/kph/:
 *   control  (write) one command a line; a line may span several write()s:
 *              add ID KIND ADDR MAXACTIVE FLAGS [PROG]...
 *                  KIND p (register_kprobe) or r (register_kretprobe); ADDR hex;
 *                  MAXACTIVE for r (0: the kernel's default); FLAGS bit0: install a
 *                  post_handler (such a kprobe is never jump-optimized); bit1: the
 *                  pre_handler dereferences NULL on purpose (kph_null_deref_handler),
 *                  to reproduce a crashing probe handler. One PROG per
 *                  fetch arg (below). A refusal by the kernel is a result, shown in
 *                  `list` as "ID ... rejected -ERRNO"; a malformed line fails the write
 *                  with EINVAL and its reason is the `error` line of `stats`.
 *              del ID | reset | record on | record off
 *   events   (read) drains: one line per record since the last open (format below), for
 *            people (`cat`) and a replay's transcript
 *   records  (read) drains the same records as they lie in the buffer, for the harness
 *            (struct kph_rec, its items, each string's bytes padded to 8; layout below):
 *            nothing is formatted in the guest, where the text costs ~10 us a record
 *            under TCG
 *   stats    (read) recording, buffer use, drops, then "probe ID KIND nhit N nmissed N
 *            nentry N npost N mode MODE" per registered probe
 *   list     (read) "ID KIND ADDR registered|rejected ERR MODE maxactive N flags N nargs N
 *                    slot ADDR opcode XX insn HEX" (the instruction slot, the byte int3
 *                    replaced, and the probed instruction as the slot holds it,
 *                    p->ainsn.size bytes; "-" without a slot: an ftrace probe)
 *
 * A PROG is a postfix program over a stack of u64, ops separated by ',', operands by ':':
 *   reg:OFF   push the pt_regs field at byte OFF      imm:V     push V
 *   stack:N   push regs_get_kernel_stack_nth(N)       sp        push kernel_stack_pointer()
 *   arg:N     push regs_get_kernel_argument(N)        retval    push regs_return_value()
 *   ld:OFF    top = *(u64 *)(top + OFF), kernel       uld:OFF   the same from user memory
 *   dup       push top again
 *   current   push current (FETCH_OP_CURRENT, 7.3's $current)
 *   cpuptr    top = this CPU's copy of the per-cpu pointer top (FETCH_OP_CPU_PTR)
 *   edata:N   push argument N as the kretprobe's entry handler saved it (FETCH_OP_EDATA,
 *             6.12+'s $argN of a return probe; 0 on a kprobe)
 * and emitters, which pop an address or value and append one item to the arg's result:
 *   val               the value itself                 -> i<hex>
 *   mem:OFF:SIZE      SIZE (1,2,4,8) bytes, kernel     -> i<hex> | f<-errno>
 *   umem:OFF:SIZE     the same from user memory
 *   str:OFF:MAX       strncpy_from_kernel_nofault()    -> s<ret>:<hex bytes before the NUL>
 *   ustr:OFF:MAX      strncpy_from_user_nofault()
 *   comm              current->comm as a kernel string (pops nothing)
 *   data:HEX          an immediate string (pops nothing)
 * A failed ld/uld ends the program with the item e<-errno>, as process_fetch_insn()
 * returns at a failed dereference. Every read is a *_nofault one: handlers run in
 * atomic context. As probe_mem_read() and fetch_store_string() do in
 * kernel/trace/trace_kprobe.c, a kernel-typed read (ld, mem, str) of an address below
 * TASK_SIZE is a user read on CONFIG_ARCH_HAS_NON_OVERLAPPING_ADDRESS_SPACE (x86_64).
 *
 * events line (space separated; strings are hex, so nothing can break a line):
 *   SEQ ID KIND MODE CPU PID COMM ADDR IP RETADDR NARGS ARG...
 *   KIND pre|post|ret; MODE ftrace|optimized|int3, then ":irq" or ":task", the context of
 *   the probed call as a trace entry's flags tell it (tracing_gen_ctx(): a softirq being
 *   served, or a hardirq that is not the NMI context an int3 handler runs in); COMM hex ("-" if empty); ADDR the
 *   probed address (p->addr); IP the raw regs->ip the handler saw; RETADDR the return
 *   address of a ret record (get_kretprobe_retaddr()), regs->flags in a post record
 *   (what an emulated Jcc decided on), else 0; each ARG its items joined by ',' ("-" for
 *   none). post records carry no args.
 *
 * records layout (x86_64, little endian; harness/backends/module.py: parse_records()):
 *   struct kph_rec (72 bytes: len, id, seq, addr, ip, ret_addr, pid, cpu, kind 'p' 's'
 *   'r', mode 'f' 'o' 'i', nargs, irq, pad, comm), then up to len its items in arg order,
 *   each a struct kph_item (16 bytes: arg, type 'i' 'f' 's' 'e', pad, ret, val) and, for
 *   's', val bytes of the string (its NUL left out) padded to 8 (the padding not zeroed).
 */
#include <linux/module.h>
#include <linux/kernel.h>
#include <linux/kprobes.h>
#include <linux/debugfs.h>
#include <linux/seq_file.h>
#include <linux/uaccess.h>
#include <linux/slab.h>
#include <linux/vmalloc.h>
#include <linux/mm.h>
#include <linux/spinlock.h>
#include <linux/mutex.h>
#include <linux/sched.h>
#include <linux/ptrace.h>
#include <linux/string.h>
#include <linux/atomic.h>
#include <linux/list.h>
#include <linux/rculist.h>
/* hex2bin()/bin2hex() moved out of kernel.h into their own header in 7.x. */
#if __has_include(<linux/hex.h>)
#include <linux/hex.h>
#endif

#define KPH_MAX_ARGS	128		/* MAX_TRACE_ARGS */
#define KPH_MAX_OPS	512
#define KPH_STACK	16
#define KPH_MAX_STR	8192
#define KPH_MAX_DATA	256
#define KPH_MAX_LINE	(256 * 1024)
#define KPH_FLAG_POST	1
#define KPH_FLAG_BUG_NULL	2

static unsigned long bufsize = 4 << 20;
module_param(bufsize, ulong, 0444);
MODULE_PARM_DESC(bufsize, "bytes per record buffer (two are allocated)");

enum kph_opcode {
	OP_REG, OP_IMM, OP_STACK, OP_SP, OP_ARG, OP_RETVAL, OP_LD, OP_ULD, OP_DUP,
	OP_VAL, OP_MEM, OP_UMEM, OP_STR, OP_USTR, OP_COMM, OP_DATA,
	OP_CURRENT, OP_CPUPTR, OP_EDATA,
};

struct kph_op {
	u8 code;
	u8 size;
	u32 n;
	s64 off;
	u64 imm;
	u8 *data;
};

/* Arguments a kretprobe's entry handler saves for $argN of the return (as 6.12+ does). */
#define KPH_EDATA_ARGS 6

struct kph_prog {
	int nops;
	struct kph_op ops[];
};

struct kph_probe {
	struct list_head node;
	u32 id;
	char kind;			/* 'p' or 'r' */
	unsigned long addr;
	int maxactive;
	unsigned int flags;
	bool registered;
	int err;
	int nargs;
	struct kph_prog **args;
	atomic64_t nhit, nentry, npost;
	struct kprobe kp;
	struct kretprobe rp;
};

/* One item of an arg's result, followed by its string bytes (padded to 8). */
struct kph_item {
	u16 arg;
	u8 type;			/* 'i' int, 'f' failed read, 's' string, 'e' aborted */
	u8 pad;
	s32 ret;
	u64 val;			/* 'i': the value; 's': bytes that follow; else the address */
};

struct kph_rec {
	u32 len;
	u32 id;
	u64 seq;
	u64 addr;
	u64 ip;
	u64 ret_addr;
	u32 pid;
	u32 cpu;
	u8 kind;			/* 'p' pre, 's' post, 'r' ret */
	u8 mode;			/* 'f', 'o', 'i' */
	u16 nargs;
	u8 irq;				/* the probed call ran in an interrupt */
	u8 pad[3];
	char comm[TASK_COMM_LEN];
};

struct kph_buf {
	u8 *data;
	size_t used;
	u32 nrec;
};

static DEFINE_RAW_SPINLOCK(buf_lock);	/* bufs, active, seq, dropped */
static struct kph_buf bufs[2];
static int active;
static u64 seq;
static u64 dropped;
static bool recording;

static DEFINE_MUTEX(ctl_mutex);		/* probes, last_error, each control file's line buffer */
static DEFINE_MUTEX(drain_mutex);	/* the inactive buffer */
static LIST_HEAD(probes);
static char last_error[160] = "-";
static struct dentry *kph_dir;

/* ------------------------------------------------------------------ hit recording */

/*
 * The probe's mode as /sys/kernel/debug/kprobes/list shows it. KPROBE_FLAG_FTRACE is
 * set on our own kprobe (check_ftrace_location()); KPROBE_FLAG_OPTIMIZED only ever on
 * the optimized_kprobe that aggregates ours: register_kprobe() wraps an optimizable
 * probe in one (try_to_optimize_kprobe()), linking our p->list into its list head, and
 * get_kprobe() is not exported. So walk the ring our p->list is on (RCU: members are
 * freed after synchronize_rcu()). Like kprobe_optimized(), this counts a probe queued
 * for optimization as optimized.
 */
static char kph_mode(struct kprobe *p)
{
	struct list_head *n;
	int guard = 0;

	if (READ_ONCE(p->flags) & KPROBE_FLAG_FTRACE)
		return 'f';
	for (n = READ_ONCE(p->list.next); n && n != &p->list && guard < 64;
	     n = READ_ONCE(n->next), guard++) {
		struct kprobe *k = container_of(n, struct kprobe, list);

		if (READ_ONCE(k->flags) & KPROBE_FLAG_OPTIMIZED)
			return 'o';
	}
	return 'i';
}

/* strncpy_from_kernel_nofault() (mm/maccess.c), which is not exported: page-sized
 * copy_from_kernel_nofault() chunks; a page reads entirely or not at all. */
static long kph_strncpy_kernel(char *dst, unsigned long src, long count)
{
	long n = 0;

	if (count <= 0)
		return 0;
	while (n < count) {
		long chunk = min_t(long, count - n, PAGE_SIZE - ((src + n) & ~PAGE_MASK));
		long ret = copy_from_kernel_nofault(dst + n, (const void *)(src + n), chunk);
		char *z;

		if (ret) {
			dst[0] = '\0';
			return n == 0 ? ret : -EFAULT;
		}
		z = memchr(dst + n, '\0', chunk);
		if (z)
			return z - dst + 1;
		n += chunk;
	}
	dst[count - 1] = '\0';
	return count;
}

/* strncpy_from_user_nofault() (mm/maccess.c), which is not exported, verbatim. */
static long kph_strncpy_user(char *dst, unsigned long src, long count)
{
	long ret;

	if (count <= 0)
		return 0;
	pagefault_disable();
	ret = strncpy_from_user(dst, (const char __user *)src, count);
	pagefault_enable();
	if (ret >= count) {
		ret = count;
		dst[ret - 1] = '\0';
	} else if (ret > 0) {
		ret++;
	}
	return ret;
}

/*
 * probe_mem_read() / probe_mem_read_user() of kernel/trace/trace_kprobe.c: where user
 * and kernel addresses cannot overlap, a kernel read below TASK_SIZE reads user memory.
 */
static bool kph_user_addr(unsigned long addr, bool user)
{
#ifdef CONFIG_ARCH_HAS_NON_OVERLAPPING_ADDRESS_SPACE
	if (addr < TASK_SIZE)
		return true;
#endif
	return user;
}

static long kph_read(void *dst, unsigned long src, size_t size, bool user)
{
	if (kph_user_addr(src, user))
		return copy_from_user_nofault(dst, (const void __user *)src, size);
	return copy_from_kernel_nofault(dst, (const void *)src, size);
}

static struct kph_item *kph_item_at(u8 *buf, size_t *pos, size_t end, u16 argi,
				    u8 type, s32 ret, u64 val)
{
	struct kph_item *it;

	if (end - *pos < sizeof(*it))
		return NULL;
	it = (struct kph_item *)(buf + *pos);
	it->arg = argi;
	it->type = type;
	it->pad = 0;
	it->ret = ret;
	it->val = val;
	*pos += sizeof(*it);
	return it;
}

/* A string item: the bytes go straight into the buffer. -ENOSPC when they do not fit. */
static int kph_emit_str(u8 *buf, size_t *pos, size_t end, u16 argi, int kind,
			unsigned long addr, long maxlen, const u8 *data, u32 dlen)
{
	struct kph_item *it;
	size_t start = *pos;
	long room, count, ret;
	char *dst;

	it = kph_item_at(buf, pos, end, argi, 's', 0, 0);
	if (!it)
		return -ENOSPC;
	room = end - *pos;
	count = min_t(long, maxlen, room);
	dst = (char *)(it + 1);
	if (kind == OP_DATA) {
		if ((long)dlen + 1 > room)
			goto nospace;
		memcpy(dst, data, dlen);
		ret = dlen + 1;
	} else if (kind == OP_USTR || kph_user_addr(addr, false)) {
		ret = kph_strncpy_user(dst, addr, count);
	} else {
		ret = kph_strncpy_kernel(dst, addr, count);
	}
	if (ret >= count && count < maxlen)	/* cut short by the buffer, not by MAX */
		goto nospace;
	it->ret = ret;
	it->val = ret > 0 ? ret - 1 : 0;
	*pos += ALIGN(it->val, 8);
	return 0;
nospace:
	*pos = start;
	return -ENOSPC;
}

/* Run one arg's program; its items are appended at *pos. -ENOSPC when full. */
static int kph_run(const struct kph_prog *prog, u16 argi, struct pt_regs *regs,
		   const unsigned long *edata, u8 *buf, size_t *pos, size_t end)
{
	u64 st[KPH_STACK];
	int sp = 0, i;

	for (i = 0; i < prog->nops; i++) {
		const struct kph_op *op = &prog->ops[i];
		unsigned long a;
		u64 v = 0;
		long ret;

		switch (op->code) {
		case OP_REG:
			st[sp++] = regs_get_register(regs, op->n);
			break;
		case OP_IMM:
			st[sp++] = op->imm;
			break;
		case OP_STACK:
			st[sp++] = regs_get_kernel_stack_nth(regs, op->n);
			break;
		case OP_SP:
			st[sp++] = kernel_stack_pointer(regs);
			break;
		case OP_ARG:
			st[sp++] = regs_get_kernel_argument(regs, op->n);
			break;
		case OP_RETVAL:
			st[sp++] = regs_return_value(regs);
			break;
		case OP_DUP:
			st[sp] = st[sp - 1];
			sp++;
			break;
		case OP_CURRENT:
			st[sp++] = (unsigned long)current;
			break;
		case OP_CPUPTR:
			st[sp - 1] = (unsigned long)raw_cpu_ptr((void __percpu *)st[sp - 1]);
			break;
		case OP_EDATA:
			st[sp++] = edata && op->n < KPH_EDATA_ARGS ? edata[op->n] : 0;
			break;
		case OP_LD:
		case OP_ULD:
			a = st[sp - 1] + op->off;
			ret = kph_read(&v, a, sizeof(v), op->code == OP_ULD);
			if (ret)
				return kph_item_at(buf, pos, end, argi, 'e', ret, a) ? 0 : -ENOSPC;
			st[sp - 1] = v;
			break;
		case OP_VAL:
			if (!kph_item_at(buf, pos, end, argi, 'i', 0, st[--sp]))
				return -ENOSPC;
			break;
		case OP_MEM:
		case OP_UMEM:
			a = st[--sp] + op->off;
			ret = kph_read(&v, a, op->size, op->code == OP_UMEM);
			if (!kph_item_at(buf, pos, end, argi, ret ? 'f' : 'i', ret, ret ? a : v))
				return -ENOSPC;
			break;
		case OP_STR:
		case OP_USTR:
			a = st[--sp] + op->off;
			if (kph_emit_str(buf, pos, end, argi, op->code, a, op->n, NULL, 0))
				return -ENOSPC;
			break;
		case OP_COMM:
			if (kph_emit_str(buf, pos, end, argi, OP_STR,
					 (unsigned long)current->comm, op->n, NULL, 0))
				return -ENOSPC;
			break;
		case OP_DATA:
			if (kph_emit_str(buf, pos, end, argi, OP_DATA, 0, op->n + 1,
					 op->data, op->n))
				return -ENOSPC;
			break;
		}
	}
	return 0;
}

static void kph_record(struct kph_probe *pr, u8 kind, struct kprobe *p,
		       struct pt_regs *regs, unsigned long ret_addr, bool with_args,
		       const unsigned long *edata)
{
	struct kph_buf *b;
	struct kph_rec *r;
	unsigned long flags;
	size_t start, pos;
	int i;

	raw_spin_lock_irqsave(&buf_lock, flags);
	b = &bufs[active];
	start = b->used;
	if (bufsize - start < sizeof(*r))
		goto full;
	r = (struct kph_rec *)(b->data + start);
	r->id = pr->id;
	r->addr = (unsigned long)p->addr;
	r->ip = instruction_pointer(regs);
	r->ret_addr = ret_addr;
	r->pid = current->pid;
	r->cpu = smp_processor_id();
	r->kind = kind;
	r->mode = kph_mode(p);
	r->nargs = with_args ? pr->nargs : 0;
	r->irq = in_serving_softirq() || (in_hardirq() && !in_nmi());
	memset(r->pad, 0, sizeof(r->pad));
	memcpy(r->comm, current->comm, TASK_COMM_LEN);
	pos = start + sizeof(*r);
	for (i = 0; i < r->nargs; i++)
		if (kph_run(pr->args[i], i, regs, edata, b->data, &pos, bufsize))
			goto full;
	r->len = pos - start;
	r->seq = seq++;
	b->used = pos;
	b->nrec++;
	raw_spin_unlock_irqrestore(&buf_lock, flags);
	return;
full:
	dropped++;
	raw_spin_unlock_irqrestore(&buf_lock, flags);
}

/*
 * A probe handler with a bug, on request (FLAGS bit1): it reads through a NULL pointer
 * in kprobe context, the classic way a handler takes the kernel down. Kept out of line
 * so the Oops names it.
 */
static noinline unsigned long kph_null_deref_handler(struct kph_probe *pr)
{
	unsigned long *volatile p = NULL;

	pr_info("kph: probe %u: dereferencing NULL in a kprobe handler, as asked\n", pr->id);
	return *p;
}
NOKPROBE_SYMBOL(kph_null_deref_handler);

static int kph_pre(struct kprobe *p, struct pt_regs *regs)
{
	struct kph_probe *pr = container_of(p, struct kph_probe, kp);

	if (unlikely(pr->flags & KPH_FLAG_BUG_NULL) && READ_ONCE(recording))
		kph_null_deref_handler(pr);
	if (READ_ONCE(recording)) {
		atomic64_inc(&pr->nhit);
		kph_record(pr, 'p', p, regs, 0, true, NULL);
	}
	return 0;
}
NOKPROBE_SYMBOL(kph_pre);

static void kph_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	struct kph_probe *pr = container_of(p, struct kph_probe, kp);

	if (READ_ONCE(recording)) {
		atomic64_inc(&pr->npost);
		kph_record(pr, 's', p, regs, regs->flags, false, NULL);
	}
}
NOKPROBE_SYMBOL(kph_post);

static int kph_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	struct kretprobe *rp = get_kretprobe(ri);
	unsigned long *edata = (unsigned long *)ri->data;
	int i;

	/* store_trace_entry_data(): the entry's arguments, for $argN of the return */
	for (i = 0; i < KPH_EDATA_ARGS; i++)
		edata[i] = regs_get_kernel_argument(regs, i);
	if (rp && READ_ONCE(recording))
		atomic64_inc(&container_of(rp, struct kph_probe, rp)->nentry);
	return 0;
}
NOKPROBE_SYMBOL(kph_entry);

static int kph_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	struct kretprobe *rp = get_kretprobe(ri);
	struct kph_probe *pr;

	if (!rp || !READ_ONCE(recording))
		return 0;
	pr = container_of(rp, struct kph_probe, rp);
	atomic64_inc(&pr->nhit);
	kph_record(pr, 'r', &rp->kp, regs, get_kretprobe_retaddr(ri), true,
		   (const unsigned long *)ri->data);
	return 0;
}
NOKPROBE_SYMBOL(kph_ret);

/* ------------------------------------------------------------------ probes */

static struct kph_probe *kph_find(u32 id)
{
	struct kph_probe *pr;

	list_for_each_entry(pr, &probes, node)
		if (pr->id == id)
			return pr;
	return NULL;
}

static void kph_free(struct kph_probe *pr)
{
	int i, j;

	for (i = 0; i < pr->nargs; i++) {
		if (!pr->args[i])
			continue;
		for (j = 0; j < pr->args[i]->nops; j++)
			kfree(pr->args[i]->ops[j].data);
		kfree(pr->args[i]);
	}
	kfree(pr->args);
	kfree(pr);
}

static void kph_unregister(struct kph_probe *pr)
{
	if (!pr->registered)
		return;
	if (pr->kind == 'p')
		unregister_kprobe(&pr->kp);
	else
		unregister_kretprobe(&pr->rp);
	pr->registered = false;
}

/* Unregister everything in two batches (one RCU grace period each), then free. */
static void kph_reset(void)
{
	struct kph_probe *pr, *tmp;
	struct kprobe **kps;
	struct kretprobe **rps;
	int n = 0, nk = 0, nr = 0;

	list_for_each_entry(pr, &probes, node)
		n++;
	kps = kcalloc(n + 1, sizeof(*kps), GFP_KERNEL);
	rps = kcalloc(n + 1, sizeof(*rps), GFP_KERNEL);
	list_for_each_entry(pr, &probes, node) {
		if (!pr->registered)
			continue;
		if (!kps || !rps)
			kph_unregister(pr);
		else if (pr->kind == 'p')
			kps[nk++] = &pr->kp;
		else
			rps[nr++] = &pr->rp;
	}
	if (nk)
		unregister_kprobes(kps, nk);
	if (nr)
		unregister_kretprobes(rps, nr);
	kfree(kps);
	kfree(rps);
	list_for_each_entry_safe(pr, tmp, &probes, node) {
		list_del(&pr->node);
		kph_free(pr);
	}
}

static const char *kph_mode_name(struct kph_probe *pr)
{
	if (!pr->registered)
		return "-";
	switch (kph_mode(pr->kind == 'p' ? &pr->kp : &pr->rp.kp)) {
	case 'f':
		return "ftrace";
	case 'o':
		return "optimized";
	default:
		return "int3";
	}
}

/* ------------------------------------------------------------------ control */

static int kph_fail(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
	pr_warn("kph_kprobes: %s\n", last_error);
	return -EINVAL;
}

static int kph_num_s64(char *s, s64 *out)
{
	return s && *s ? kstrtoll(s, 0, out) : -EINVAL;
}

static int kph_num_u32(char *s, u32 *out)
{
	return s && *s ? kstrtouint(s, 0, out) : -EINVAL;
}

/* Parse "op[:a[:b]],op..." into a program; checks stack depth statically. */
static struct kph_prog *kph_parse_prog(char *text, int argi)
{
	struct kph_prog *prog;
	char *tok, *p;
	int n = 1, depth = 0;

	for (p = text; *p; p++)
		n += *p == ',';
	if (n > KPH_MAX_OPS) {
		kph_fail("arg %d: more than %d ops", argi, KPH_MAX_OPS);
		return NULL;
	}
	prog = kzalloc(struct_size(prog, ops, n), GFP_KERNEL);
	if (!prog) {
		kph_fail("out of memory");
		return NULL;
	}
	while ((tok = strsep(&text, ",")) != NULL) {
		struct kph_op *op = &prog->ops[prog->nops];
		char *name = strsep(&tok, ":");
		char *a1 = strsep(&tok, ":");
		char *a2 = strsep(&tok, ":");
		int pops = 0, pushes = 0, bad = 0;

		prog->nops++;
		if (!strcmp(name, "reg")) {
			op->code = OP_REG;
			bad = kph_num_u32(a1, &op->n) || op->n % 8 || op->n > MAX_REG_OFFSET;
			pushes = 1;
		} else if (!strcmp(name, "imm")) {
			op->code = OP_IMM;
			bad = !a1 || kstrtoull(a1, 0, &op->imm);
			pushes = 1;
		} else if (!strcmp(name, "stack")) {
			op->code = OP_STACK;
			bad = kph_num_u32(a1, &op->n);
			pushes = 1;
		} else if (!strcmp(name, "sp")) {
			op->code = OP_SP;
			pushes = 1;
		} else if (!strcmp(name, "arg")) {
			op->code = OP_ARG;
			bad = kph_num_u32(a1, &op->n);
			pushes = 1;
		} else if (!strcmp(name, "retval")) {
			op->code = OP_RETVAL;
			pushes = 1;
		} else if (!strcmp(name, "ld") || !strcmp(name, "uld")) {
			op->code = name[0] == 'u' ? OP_ULD : OP_LD;
			bad = kph_num_s64(a1, &op->off);
			pops = pushes = 1;
		} else if (!strcmp(name, "current")) {
			op->code = OP_CURRENT;
			pushes = 1;
		} else if (!strcmp(name, "cpuptr")) {
			op->code = OP_CPUPTR;
			pops = pushes = 1;
		} else if (!strcmp(name, "edata")) {
			op->code = OP_EDATA;
			bad = kph_num_u32(a1, &op->n) || op->n >= KPH_EDATA_ARGS;
			pushes = 1;
		} else if (!strcmp(name, "dup")) {
			op->code = OP_DUP;
			pops = 1;
			pushes = 2;
		} else if (!strcmp(name, "val")) {
			op->code = OP_VAL;
			pops = 1;
		} else if (!strcmp(name, "mem") || !strcmp(name, "umem")) {
			u32 size = 0;

			op->code = name[0] == 'u' ? OP_UMEM : OP_MEM;
			bad = kph_num_s64(a1, &op->off) || kph_num_u32(a2, &size) ||
			      (size != 1 && size != 2 && size != 4 && size != 8);
			op->size = size;
			pops = 1;
		} else if (!strcmp(name, "str") || !strcmp(name, "ustr")) {
			op->code = name[0] == 'u' ? OP_USTR : OP_STR;
			bad = kph_num_s64(a1, &op->off) || kph_num_u32(a2, &op->n) ||
			      op->n == 0 || op->n > KPH_MAX_STR;
			pops = 1;
		} else if (!strcmp(name, "comm")) {
			op->code = OP_COMM;
			op->n = TASK_COMM_LEN;
		} else if (!strcmp(name, "data")) {
			size_t len = a1 ? strlen(a1) : 1;

			op->code = OP_DATA;
			bad = len % 2 || len / 2 > KPH_MAX_DATA;
			if (!bad) {
				op->n = len / 2;
				op->data = kmalloc(op->n + 1, GFP_KERNEL);
				bad = !op->data || hex2bin(op->data, a1, op->n);
			}
		} else {
			kph_fail("arg %d: unknown op '%s'", argi, name);
			goto err;
		}
		if (bad) {
			kph_fail("arg %d: bad operands for '%s'", argi, name);
			goto err;
		}
		if (depth < pops) {
			kph_fail("arg %d: '%s' needs a value on the stack", argi, name);
			goto err;
		}
		depth += pushes - pops;
		if (depth > KPH_STACK) {
			kph_fail("arg %d: stack deeper than %d", argi, KPH_STACK);
			goto err;
		}
	}
	return prog;
err:
	for (n = 0; n < prog->nops; n++)
		kfree(prog->ops[n].data);
	kfree(prog);
	return NULL;
}

static int kph_add(char *line)
{
	char *tok[5];
	struct kph_probe *pr;
	unsigned long addr;
	u32 id, maxactive, flags;
	char *p;
	int i, nargs = 0;

	for (i = 0; i < 5; i++) {
		tok[i] = strsep(&line, " \t");
		if (!tok[i] || !*tok[i])
			return kph_fail("add: expected ID KIND ADDR MAXACTIVE FLAGS [PROG]...");
	}
	if (kstrtouint(tok[0], 0, &id) || (strcmp(tok[1], "p") && strcmp(tok[1], "r")) ||
	    kstrtoul(tok[2], 16, &addr) || kstrtouint(tok[3], 0, &maxactive) ||
	    kstrtouint(tok[4], 0, &flags))
		return kph_fail("add: bad ID, KIND, ADDR, MAXACTIVE or FLAGS");
	if (kph_find(id))
		return kph_fail("add: ID %u exists", id);
	for (p = line; p && *p; ) {
		while (*p == ' ' || *p == '\t')
			p++;
		if (!*p)
			break;
		nargs++;
		while (*p && *p != ' ' && *p != '\t')
			p++;
	}
	if (nargs > KPH_MAX_ARGS)
		return kph_fail("add %u: more than %d args", id, KPH_MAX_ARGS);
	pr = kzalloc(sizeof(*pr), GFP_KERNEL);
	if (!pr)
		return kph_fail("out of memory");
	pr->args = kcalloc(nargs + 1, sizeof(*pr->args), GFP_KERNEL);
	if (!pr->args) {
		kfree(pr);
		return kph_fail("out of memory");
	}
	pr->id = id;
	pr->kind = tok[1][0];
	pr->addr = addr;
	pr->maxactive = maxactive;
	pr->flags = flags;
	while ((p = strsep(&line, " \t")) != NULL) {
		if (!*p)
			continue;
		pr->args[pr->nargs] = kph_parse_prog(p, pr->nargs);
		if (!pr->args[pr->nargs]) {
			kph_free(pr);
			return -EINVAL;
		}
		pr->nargs++;
	}
	if (pr->kind == 'p') {
		pr->kp.addr = (kprobe_opcode_t *)addr;
		pr->kp.pre_handler = kph_pre;
		if (flags & KPH_FLAG_POST)
			pr->kp.post_handler = kph_post;
		pr->err = register_kprobe(&pr->kp);
	} else {
		pr->rp.kp.addr = (kprobe_opcode_t *)addr;
		pr->rp.handler = kph_ret;
		pr->rp.entry_handler = kph_entry;
		pr->rp.maxactive = maxactive;
		pr->rp.data_size = KPH_EDATA_ARGS * sizeof(unsigned long);
		pr->err = register_kretprobe(&pr->rp);
	}
	pr->registered = pr->err == 0;
	list_add_tail(&pr->node, &probes);
	return 0;
}

static int kph_exec(char *line)
{
	char *cmd;
	u32 id;

	line = strim(line);
	if (!*line || *line == '#')
		return 0;
	cmd = strsep(&line, " \t");
	if (!strcmp(cmd, "add"))
		return kph_add(line ? skip_spaces(line) : "");
	if (!strcmp(cmd, "del")) {
		struct kph_probe *pr;

		if (!line || kstrtouint(strim(line), 0, &id))
			return kph_fail("del: expected ID");
		pr = kph_find(id);
		if (!pr)
			return kph_fail("del: no probe %u", id);
		kph_unregister(pr);
		list_del(&pr->node);
		kph_free(pr);
		return 0;
	}
	if (!strcmp(cmd, "reset")) {
		kph_reset();
		return 0;
	}
	if (!strcmp(cmd, "record")) {
		line = line ? strim(line) : "";
		if (strcmp(line, "on") && strcmp(line, "off"))
			return kph_fail("record: expected on or off");
		WRITE_ONCE(recording, !strcmp(line, "on"));
		return 0;
	}
	return kph_fail("unknown command '%s'", cmd);
}

struct kph_ctl {
	size_t len;
	char buf[KPH_MAX_LINE];
};

static int kph_ctl_open(struct inode *inode, struct file *file)
{
	struct kph_ctl *ctl = kvmalloc(sizeof(*ctl), GFP_KERNEL);

	if (!ctl)
		return -ENOMEM;
	ctl->len = 0;
	file->private_data = ctl;
	return 0;
}

/* Under ctl_mutex: run every complete line in ctl->buf; keep a trailing partial one. */
static int kph_ctl_lines(struct kph_ctl *ctl, bool all)
{
	char *start = ctl->buf, *nl;
	int ret = 0;

	lockdep_assert_held(&ctl_mutex);
	while (!ret) {
		nl = memchr(start, '\n', ctl->buf + ctl->len - start);
		if (!nl) {
			if (!all || start == ctl->buf + ctl->len)
				break;
			nl = ctl->buf + ctl->len;	/* ctl->buf has room for the NUL */
		}
		*nl = '\0';
		ret = kph_exec(start);
		start = nl + (nl < ctl->buf + ctl->len);
	}
	if (ret)
		ctl->len = 0;
	else {
		ctl->len -= start - ctl->buf;
		memmove(ctl->buf, start, ctl->len);
	}
	return ret;
}

static ssize_t kph_ctl_write(struct file *file, const char __user *ubuf, size_t count,
			     loff_t *ppos)
{
	struct kph_ctl *ctl = file->private_data;
	int ret;

	/*
	 * One writer at a time, the whole command: writers sharing an open file (threads,
	 * a forked shell's `>&3`) share ctl->buf and ctl->len, and the checks below, the
	 * append and the lines it completes must not interleave with another's.
	 */
	mutex_lock(&ctl_mutex);
	if (count >= KPH_MAX_LINE - ctl->len) {
		ret = -E2BIG;
	} else if (copy_from_user(ctl->buf + ctl->len, ubuf, count)) {
		ret = -EFAULT;
	} else {
		ctl->len += count;
		ret = kph_ctl_lines(ctl, false);
	}
	mutex_unlock(&ctl_mutex);
	return ret ? ret : count;
}

static int kph_ctl_release(struct inode *inode, struct file *file)
{
	struct kph_ctl *ctl = file->private_data;

	mutex_lock(&ctl_mutex);
	if (ctl->len)
		kph_ctl_lines(ctl, true);
	mutex_unlock(&ctl_mutex);
	kvfree(ctl);
	return 0;
}

static const struct file_operations kph_ctl_fops = {
	.owner = THIS_MODULE,
	.open = kph_ctl_open,
	.write = kph_ctl_write,
	.release = kph_ctl_release,
	.llseek = noop_llseek,
};

/* ------------------------------------------------------------------ events */

struct kph_text {
	size_t len;
	char data[];
};

static size_t kph_text_bound(const struct kph_buf *b)
{
	size_t pos = 0, bound = 1;

	while (pos < b->used) {
		const struct kph_rec *r = (const void *)(b->data + pos);
		size_t ipos = pos + sizeof(*r);

		bound += 256 + 2 * (size_t)r->nargs;
		while (ipos < pos + r->len) {
			const struct kph_item *it = (const void *)(b->data + ipos);
			size_t n = it->type == 's' ? it->val : 0;

			bound += 32 + 2 * n;
			ipos += sizeof(*it) + ALIGN(n, 8);
		}
		pos += r->len;
	}
	return bound;
}

static struct kph_text *kph_format(const struct kph_buf *b)
{
	size_t cap = kph_text_bound(b), pos = 0;
	struct kph_text *t = kvmalloc(sizeof(*t) + cap, GFP_KERNEL);
	char *o;

	if (!t)
		return NULL;
	o = t->data;
	while (pos < b->used) {
		const struct kph_rec *r = (const void *)(b->data + pos);
		size_t ipos = pos + sizeof(*r), clen = strnlen(r->comm, TASK_COMM_LEN);
		int a;

		o += sprintf(o, "%llu %u %s %s:%s %u %u ", r->seq, r->id,
			     r->kind == 'p' ? "pre" : r->kind == 's' ? "post" : "ret",
			     r->mode == 'f' ? "ftrace" : r->mode == 'o' ? "optimized" : "int3",
			     r->irq ? "irq" : "task", r->cpu, r->pid);
		if (clen)
			o = bin2hex(o, r->comm, clen);
		else
			*o++ = '-';
		o += sprintf(o, " %llx %llx %llx %u", r->addr, r->ip, r->ret_addr, r->nargs);
		for (a = 0; a < r->nargs; a++) {
			int n = 0;

			*o++ = ' ';
			while (ipos < pos + r->len) {
				const struct kph_item *it = (const void *)(b->data + ipos);
				size_t dl = it->type == 's' ? it->val : 0;

				if (it->arg != a)
					break;
				if (n++)
					*o++ = ',';
				if (it->type == 'i')
					o += sprintf(o, "i%llx", it->val);
				else if (it->type == 's') {
					o += sprintf(o, "s%d:", it->ret);
					o = bin2hex(o, (const u8 *)(it + 1), dl);
				} else
					o += sprintf(o, "%c%d", it->type, it->ret);
				ipos += sizeof(*it) + ALIGN(dl, 8);
			}
			if (!n)
				*o++ = '-';
		}
		*o++ = '\n';
		pos += r->len;
	}
	t->len = o - t->data;
	return t;
}

/* The drain as it lies in the buffer: records and items, for the `records` file. */
static struct kph_text *kph_copy(const struct kph_buf *b)
{
	struct kph_text *t = kvmalloc(sizeof(*t) + b->used, GFP_KERNEL);

	if (!t)
		return NULL;
	memcpy(t->data, b->data, b->used);
	t->len = b->used;
	return t;
}

/*
 * Opening `events` or `records` drains: the active buffer is swapped for the other and
 * its records are made into the file's text (kph_format()) or copied (kph_copy(), the
 * file's i_private), then the buffer is emptied for the next swap.
 */
static int kph_events_open(struct inode *inode, struct file *file)
{
	struct kph_text *(*drain)(const struct kph_buf *b) =
		inode->i_private ? kph_copy : kph_format;
	struct kph_buf *snap;
	struct kph_text *t;
	unsigned long flags;

	mutex_lock(&drain_mutex);
	raw_spin_lock_irqsave(&buf_lock, flags);
	snap = &bufs[active];
	active ^= 1;
	raw_spin_unlock_irqrestore(&buf_lock, flags);
	t = drain(snap);
	snap->used = 0;
	snap->nrec = 0;
	mutex_unlock(&drain_mutex);
	if (!t)
		return -ENOMEM;
	file->private_data = t;
	return 0;
}

static ssize_t kph_events_read(struct file *file, char __user *ubuf, size_t count,
			       loff_t *ppos)
{
	struct kph_text *t = file->private_data;

	return simple_read_from_buffer(ubuf, count, ppos, t->data, t->len);
}

static int kph_events_release(struct inode *inode, struct file *file)
{
	kvfree(file->private_data);
	return 0;
}

static const struct file_operations kph_events_fops = {
	.owner = THIS_MODULE,
	.open = kph_events_open,
	.read = kph_events_read,
	.release = kph_events_release,
	.llseek = default_llseek,
};

/* ------------------------------------------------------------------ stats, list */

static int kph_stats_show(struct seq_file *m, void *v)
{
	struct kph_probe *pr;
	unsigned long flags;
	size_t used;
	u32 nrec;
	u64 d, s;

	raw_spin_lock_irqsave(&buf_lock, flags);
	used = bufs[active].used;
	nrec = bufs[active].nrec;
	d = dropped;
	s = seq;
	raw_spin_unlock_irqrestore(&buf_lock, flags);
	seq_printf(m, "recording %d\n", READ_ONCE(recording));
	seq_printf(m, "buffer size %lu used %zu records %u dropped %llu seq %llu\n",
		   bufsize, used, nrec, d, s);
	mutex_lock(&ctl_mutex);
	seq_printf(m, "error %s\n", last_error);
	list_for_each_entry(pr, &probes, node) {
		unsigned long nmissed;

		if (!pr->registered)
			continue;
		nmissed = pr->kind == 'p' ? pr->kp.nmissed : pr->rp.kp.nmissed + pr->rp.nmissed;
		seq_printf(m, "probe %u %c nhit %lld nmissed %lu nentry %lld npost %lld mode %s\n",
			   pr->id, pr->kind, atomic64_read(&pr->nhit), nmissed,
			   atomic64_read(&pr->nentry), atomic64_read(&pr->npost),
			   kph_mode_name(pr));
	}
	mutex_unlock(&ctl_mutex);
	return 0;
}

static int kph_list_show(struct seq_file *m, void *v)
{
	struct kph_probe *pr;

	mutex_lock(&ctl_mutex);
	list_for_each_entry(pr, &probes, node) {
		/* slot/opcode: the out-of-line copy of the probed instruction and the byte the
		 * int3 replaced (kph demo trap-flow shows them; an ftrace probe has no slot). */
		struct kprobe *k = pr->kind == 'r' ? &pr->rp.kp : &pr->kp;
		u8 insn[MAX_INSN_SIZE];
		int n = 0;

		/* arch_copy_kprobe(): the copy of the instruction (a RIP-relative
		 * displacement adjusted to the slot; branches' rel8/rel32 as they are) */
		if (pr->registered && k->ainsn.insn && k->ainsn.size <= MAX_INSN_SIZE &&
		    !copy_from_kernel_nofault(insn, k->ainsn.insn, k->ainsn.size))
			n = k->ainsn.size;

		seq_printf(m, "%u %c %lx %s %d %s maxactive %d flags %u nargs %d slot %px opcode %02x insn ",
			   pr->id, pr->kind, pr->addr,
			   pr->registered ? "registered" : "rejected", pr->err,
			   kph_mode_name(pr),
			   pr->kind == 'r' && pr->registered ? pr->rp.maxactive : pr->maxactive,
			   pr->flags, pr->nargs,
			   pr->registered ? (void *)k->ainsn.insn : NULL,
			   pr->registered ? k->opcode : 0);
		if (n)
			seq_printf(m, "%*phN\n", n, insn);
		else
			seq_puts(m, "-\n");
	}
	mutex_unlock(&ctl_mutex);
	return 0;
}

static int kph_stats_open(struct inode *inode, struct file *file)
{
	return single_open(file, kph_stats_show, NULL);
}

static int kph_list_open(struct inode *inode, struct file *file)
{
	return single_open(file, kph_list_show, NULL);
}

static const struct file_operations kph_stats_fops = {
	.owner = THIS_MODULE,
	.open = kph_stats_open,
	.read = seq_read,
	.llseek = seq_lseek,
	.release = single_release,
};

static const struct file_operations kph_list_fops = {
	.owner = THIS_MODULE,
	.open = kph_list_open,
	.read = seq_read,
	.llseek = seq_lseek,
	.release = single_release,
};

/* ------------------------------------------------------------------ module */

static int __init kph_init(void)
{
	/* the `records` layout harness/backends/module.py decodes (REC, ITEM there) */
	BUILD_BUG_ON(sizeof(struct kph_rec) != 72 || offsetof(struct kph_rec, comm) != 56);
	BUILD_BUG_ON(sizeof(struct kph_item) != 16);
	bufsize = ALIGN(max(bufsize, PAGE_SIZE), PAGE_SIZE);
	bufs[0].data = vmalloc(bufsize);
	bufs[1].data = vmalloc(bufsize);
	if (!bufs[0].data || !bufs[1].data)
		goto nomem;
	kph_dir = debugfs_create_dir("kph", NULL);
	if (IS_ERR(kph_dir)) {
		vfree(bufs[0].data);
		vfree(bufs[1].data);
		return PTR_ERR(kph_dir);
	}
	debugfs_create_file("control", 0200, kph_dir, NULL, &kph_ctl_fops);
	debugfs_create_file("events", 0400, kph_dir, NULL, &kph_events_fops);
	debugfs_create_file("records", 0400, kph_dir, (void *)1, &kph_events_fops);
	debugfs_create_file("stats", 0444, kph_dir, NULL, &kph_stats_fops);
	debugfs_create_file("list", 0444, kph_dir, NULL, &kph_list_fops);
	return 0;
nomem:
	vfree(bufs[0].data);
	vfree(bufs[1].data);
	return -ENOMEM;
}

static void __exit kph_exit(void)
{
	WRITE_ONCE(recording, false);
	debugfs_remove_recursive(kph_dir);
	mutex_lock(&ctl_mutex);
	kph_reset();
	mutex_unlock(&ctl_mutex);
	vfree(bufs[0].data);
	vfree(bufs[1].data);
}

module_init(kph_init);
module_exit(kph_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kprobe-harness: kprobes and kretprobes from a control file, hits recorded");
