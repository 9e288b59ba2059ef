// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * The probe targets of lib/test_kprobes.c (Linux 6.1, "simple sanity test for *probes",
 * Copyright IBM Corp. 2008), without its KUnit cases: those run host-side, through the
 * harness's Python kprobes API (tests/vm/test_kunit_kprobes.py).
 *
 * Writing to /sys/kernel/debug/kph_test_kprobes/run calls, through a function pointer as
 * the KUnit suite does (so the targets stay out of line):
 *   "target N"    kprobe_target(N)  = N / 3
 *   "target2 N"   kprobe_target2(N) = N / 3 + 1
 *   "stacktrace"  kprobe_stacktrace_driver() -> kprobe_stacktrace_target()
 *                 -> kprobe_stacktrace_internal_target()
 *   "gstack"      the same, with the guest's own kretprobe on kprobe_stacktrace_target()
 *   "gstack2"     ... and one on kprobe_stacktrace_internal_target() (nested)
 *                 whose handler (the innermost's) saves stack_trace_save() (KUnit's
 *                 test_stacktrace_on_kretprobe / _on_nested_kretprobe, run in the guest)
 * Reading /sys/kernel/debug/kph_test_kprobes/result gives "RET RA0 RA1": the last return
 * value (decimal) and target_return_address[0] and [1] (hex); .../gtrace the last saved
 * stack trace, one address (hex) a line.
 */
#include <linux/debugfs.h>
#include <linux/kernel.h>
#include <linux/kprobes.h>
#include <linux/stacktrace.h>
#include <linux/module.h>
#include <linux/seq_file.h>
#include <linux/uaccess.h>

#define div_factor 3

static u32 (*target)(u32 value);
static u32 (*target2)(u32 value);
static unsigned long (*internal_target)(void);
static unsigned long (*stacktrace_target)(void);
static unsigned long (*stacktrace_driver)(void);
static unsigned long target_return_address[2];
static unsigned long last;
static struct dentry *dir;
#define GTRACE_MAX 32
static unsigned long gtrace[GTRACE_MAX];
static unsigned int gtrace_n;

static noinline u32 kprobe_target(u32 value)
{
	return (value / div_factor);
}

static noinline u32 kprobe_target2(u32 value)
{
	return (value / div_factor) + 1;
}

static noinline unsigned long kprobe_stacktrace_internal_target(void)
{
	if (!target_return_address[0])
		target_return_address[0] = (unsigned long)__builtin_return_address(0);
	return target_return_address[0];
}

static noinline unsigned long kprobe_stacktrace_target(void)
{
	if (!target_return_address[1])
		target_return_address[1] = (unsigned long)__builtin_return_address(0);

	if (internal_target)
		internal_target();

	return target_return_address[1];
}

static noinline unsigned long kprobe_stacktrace_driver(void)
{
	if (stacktrace_target)
		stacktrace_target();

	/* This is for preventing inlining the function */
	return (unsigned long)__builtin_return_address(0);
}

static int gstack_handler(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	gtrace_n = stack_trace_save(gtrace, GTRACE_MAX, 0);
	return 0;
}

static int gstack_outer_handler(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	return 0;
}

static struct kretprobe outer = {
	.handler = gstack_handler,
};
static struct kretprobe inner = {
	.handler = gstack_handler,
};

/* Mode 1 ("gstack"): the guest's own kretprobe on the target; mode 2 ("gstack2"): on the
 * internal target as well, the innermost one saving its stack trace; mode 0: none. */
static noinline int arm(int mode)
{
	int ret;

	gtrace_n = 0;
	if (!mode)
		return 0;
	memset(&outer, 0, sizeof(outer));
	memset(&inner, 0, sizeof(inner));
	outer.kp.addr = (kprobe_opcode_t *)kprobe_stacktrace_target;
	outer.handler = mode == 2 ? gstack_outer_handler : gstack_handler;
	inner.kp.addr = (kprobe_opcode_t *)kprobe_stacktrace_internal_target;
	inner.handler = gstack_handler;
	ret = register_kretprobe(&outer);
	if (ret || mode != 2)
		return ret;
	ret = register_kretprobe(&inner);
	if (ret)
		unregister_kretprobe(&outer);
	return ret;
}

static noinline void disarm(int mode)
{
	if (mode == 2)
		unregister_kretprobe(&inner);
	if (mode)
		unregister_kretprobe(&outer);
}

/* One call site of the driver for every mode: a host-side trace of mode 0 and the
 * guest's of mode 1 or 2 share every frame below the target. */
static noinline int run_stacktrace(int mode)
{
	int ret = arm(mode);

	if (ret)
		return ret;
	last = stacktrace_driver();
	disarm(mode);
	return 0;
}

static ssize_t run_write(struct file *file, const char __user *ubuf, size_t len, loff_t *off)
{
	char buf[32];
	int mode = -1, ret;
	u32 n;

	if (len >= sizeof(buf))
		return -EINVAL;
	if (copy_from_user(buf, ubuf, len))
		return -EFAULT;
	buf[len] = '\0';
	if (sscanf(buf, "target2 %u", &n) == 1)
		last = target2(n);
	else if (sscanf(buf, "target %u", &n) == 1)
		last = target(n);
	else if (!strncmp(buf, "stacktrace", 10))
		mode = 0;
	else if (!strncmp(buf, "gstack2", 7))
		mode = 2;
	else if (!strncmp(buf, "gstack", 6))
		mode = 1;
	else
		return -EINVAL;
	if (mode >= 0) {
		ret = run_stacktrace(mode);
		if (ret)
			return ret;
	}
	return len;
}

static const struct file_operations run_fops = {
	.owner = THIS_MODULE,
	.write = run_write,
};

static int result_show(struct seq_file *m, void *v)
{
	seq_printf(m, "%lu %lx %lx\n", last, target_return_address[0],
		   target_return_address[1]);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(result);

static int gtrace_show(struct seq_file *m, void *v)
{
	unsigned int i;

	for (i = 0; i < gtrace_n; i++)
		seq_printf(m, "%lx\n", gtrace[i]);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(gtrace);

static int __init kph_test_kprobes_init(void)
{
	target = kprobe_target;
	target2 = kprobe_target2;
	stacktrace_target = kprobe_stacktrace_target;
	internal_target = kprobe_stacktrace_internal_target;
	stacktrace_driver = kprobe_stacktrace_driver;
	dir = debugfs_create_dir("kph_test_kprobes", NULL);
	debugfs_create_file("run", 0200, dir, NULL, &run_fops);
	debugfs_create_file("result", 0444, dir, NULL, &result_fops);
	debugfs_create_file("gtrace", 0444, dir, NULL, &gtrace_fops);
	return 0;
}

static void __exit kph_test_kprobes_exit(void)
{
	debugfs_remove_recursive(dir);
}

module_init(kph_test_kprobes_init);
module_exit(kph_test_kprobes_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("lib/test_kprobes.c's targets, for host-side kprobes");
