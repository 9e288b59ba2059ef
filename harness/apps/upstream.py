"""``kph upstream export``: the three kernel findings of docs/upstream.md as ``git
format-patch`` series a tracing maintainer can take: a fix in the subsystem's style
(symptom, cause, tracefs reproducer, ``Fixes:``, ``Cc: stable``) and a kselftest case
(``tools/testing/selftests/ftrace/test.d/kprobe/*.tc``), against Debian's 6.12 or 7.3
source (``kph kernel fetch SERIES``).

The series is made in a git copy of the unpacked Debian tree, kept in
``$KPH_CACHE/upstream/linux.git`` (bare; one base commit a tree, "Debian
linux-source-<version>", made once with ``git add`` of the whole tree: about 1.5 min and
0.6 GB a tree). The patch commits are made without a work tree (the edited files' blobs,
a temporary index, ``commit-tree``), so a run costs seconds; the edits are exact text
replacements that refuse a tree whose code is not what they expect.

Each series is then checked: the tree's own ``scripts/checkpatch.pl --strict`` on every
patch, and ``git am`` of the series onto a fresh checkout of the base commit (a shared
clone, sparse: the directories the series touches).

Authorship is the user's ``git config user.name``/``user.email``; ``Signed-off-by:`` only
when asked (``signoff``), as ``git format-patch -s`` adds it. What was and was not run
on a kernel is said in each patch's notes (after ``---``, dropped by ``git am``).

The module is longer than most (about 700 lines): half of it is the three commit
messages and selftests, kept beside the edits they describe.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..constants import cache_dir
from ..errors import SetupError
from ..machine.image import ksource

Progress = Callable[[str], None]

SERIES = ("6.12", "7.3")
#: checkpatch message types a series may keep, and why: a new selftest file makes
#: checkpatch ask whether MAINTAINERS needs updating (tools/testing/selftests/ftrace/ is
#: covered by the TRACING entry already); without ``--signoff`` there is no
#: Signed-off-by, which the sender adds (checkpatch: MISSING_SIGN_OFF).
ACCEPTED_NEW_FILE = "FILE_PATH_CHANGES"
ACCEPTED_NO_SIGNOFF = "MISSING_SIGN_OFF"
#: checkpatch looks each Fixes:/commit id up in the git history it runs in, and warns
#: UNKNOWN_COMMIT_ID without one: the Debian tree has no history (and the mainline one is
#: too large to fetch here). ``UPSTREAM_COMMITS`` holds each id's full hash and title as
#: the kernel's history has them, checked by tests/unit/test_upstream_export.py.
ACCEPTED_NO_HISTORY = "UNKNOWN_COMMIT_ID"
#: id -> (full hash, title, first release), from mainline's and linux-trace's logs.
UPSTREAM_COMMITS = {
    "27973e5c64b9": ("27973e5c64b9e6dbea06a3ee86ed7509147b3848",
                     "tracing/probes: Add string type check with BTF", "v6.6"),
    "9d8616034f16": ("9d8616034f161222a4ac166c1b42b6d79961c005",
                     "tracing/kprobes: Add symbol counting check when module loads", "v6.11"),
    "73f9b911faa7": ("73f9b911faa74ac5107879de05c9489c419f41bb",
                     "kprobes: Use rethook for kretprobe if possible", "v5.18"),
    "b022f0c7e404": ("", "tracing/kprobes: Return EADDRNOTAVAIL when func matches several "
                     "symbols", "v6.6"),
    "927054606d08": ("927054606d08d95827f854246293f8379480ed15",
                     "tracing/kprobes: Simplify __trace_kprobe_create() by removing gotos",
                     "v6.14"),
}
LOCK_TIMEOUT = 1800.0
FOUND_BY = "Found by differential testing against a host-side model."


# ---------------------------------------------------------------- the findings

@dataclass(frozen=True)
class Edit:
    """One exact replacement in one file (``old`` must occur exactly once)."""
    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Patch:
    subject: str
    body: str                   # the message after the subject, tags included
    edits: tuple[Edit, ...] = ()
    new_files: tuple[tuple[str, str], ...] = ()     # (path, text), mode 100644
    notes: str = ""             # after ---: what was run, what was not


@dataclass(frozen=True)
class Finding:
    name: str                   # the scenario's name in probes/scenarios/upstream/
    number: int                 # its section in docs/upstream.md
    title: str
    build: Callable[["Tree"], list[Patch]]


@dataclass(frozen=True)
class Tree:
    """A Debian tree and its base commit in the git copy."""
    series: str
    src: Path                   # the unpacked Debian tree (read only)
    version: str                # linux-source-<version>: 6.12.117-1
    repo: Path
    base: str

    def read(self, path: str) -> str:
        return git(self.repo, "show", f"{self.base}:{path}")

    def line_of(self, path: str, text: str) -> int:
        """The line (1-based) of the first line holding ``text`` in ``path``, a function's
        forward declaration (``static ...);``) left out."""
        for i, ln in enumerate(self.read(path).splitlines(), 1):
            if text in ln and not (ln.startswith("static") and ln.endswith(");")):
                return i
        raise SetupError(f"{path} of {self.version} has no {text!r}",
                         "the tree's code is not what the export knows; see harness/apps/upstream.py")


def _wrap(*paras: str) -> str:
    """Paragraphs for a commit message: prose refilled to 72 columns (checkpatch wants at
    most 75), indented blocks (commands, output) and tags as they are."""
    out = []
    for p in paras:
        p = p.strip("\n")
        if p and not p[0].isspace() and not re.match(r"^[A-Z][\w-]+: ", p, re.M):
            p = textwrap.fill(" ".join(p.split()), 72, break_on_hyphens=False,
                              break_long_words=False)
        out.append(p)
    return "\n\n".join(p for p in out if p)


def _stable_tags(commit: str, title: str) -> str:
    return f'Fixes: {commit} ("{title}")\nCc: stable@vger.kernel.org'


# -- 1. btf_type_is_char_ptr()

TRACE_PROBE_C = "kernel/trace/trace_probe.c"
TC_DIR = "tools/testing/selftests/ftrace/test.d/kprobe"

BTF_STRING_TC = """\
#!/bin/sh
# SPDX-License-Identifier: GPL-2.0
# description: Kprobe event BTF string type check refuses non-pointer types
# requires: kprobe_events "<argname>":README

# vfs_read() returns ssize_t: neither :string nor :ustring fits it.
for type in string ustring; do
	echo > error_log
	if echo "r:testprobe vfs_read ret=\\$retval:$type" > kprobe_events; then
		echo "\\$retval:$type of vfs_read() is accepted"
		exit_fail
	fi
	grep -q "This type does not fit for string." error_log
done

# A char pointer still fits: kstrdup(const char *s, gfp_t gfp)
echo "p:testprobe kstrdup s:string" > kprobe_events
echo > kprobe_events
"""


def _btf_char_ptr(t: Tree) -> list[Patch]:
    ptr = t.line_of(TRACE_PROBE_C, "static bool btf_type_is_char_ptr(")
    arr = t.line_of(TRACE_PROBE_C, "static bool btf_type_is_char_array(")
    chk = t.line_of(TRACE_PROBE_C, "static int check_prepare_btf_string_fetch(")
    fix = Patch(
        subject="tracing/probes: Fix the BTF string type check of non-pointer types",
        body=_wrap(f"""
btf_type_is_char_ptr() ({TRACE_PROBE_C}:{ptr}) reads type->type as
the id of the pointed-to type without checking that @type is a pointer.
For BTF_KIND_INT, STRUCT, UNION and ENUM that field is the size of the
type, so an 8-byte integer is taken for a pointer to type id 8. In the
x86_64 vmlinux BTF of Debian's 6.12 and 7.3 kernels, type id 8 resolves
(through a const) to an unsigned 8-bit int, so
check_prepare_btf_string_fetch() (line {chk}) accepts :string and
:ustring on a long or ssize_t value and dereferences it as a char
pointer:""", """
  # echo 'r:btfstr vfs_read ret=$retval:ustring' >> \\
         /sys/kernel/tracing/kprobe_events
  # echo 1 > /sys/kernel/tracing/events/kprobes/btfstr/enable
  # cat /proc/version > /dev/null; cat /sys/kernel/tracing/trace
  [...]
  qemu-ga-146 [000] ..... 4.209698: btfstr:
    (ksys_read+0x6d/0xf0 <- vfs_read) ret=(fault)""", "(The trace line is wrapped here.)",
            f"""
btf_type_is_char_array() (line {arr})
has the same problem one level down: it calls btf_type_int() on the
array's element type without checking that it is an integer, or that
it was found at all, so for an array of structs, pointers or arrays it
reads whatever follows the element's struct btf_type as an integer
encoding.""", """
Check the kind in both: a char pointer must be a BTF_KIND_PTR and the
element of a char array a BTF_KIND_INT. The command above then fails
with EINVAL, and error_log says "This type does not fit for string.",
as for any other type that is not a string.""", FOUND_BY,
            _stable_tags("27973e5c64b9", "tracing/probes: Add string type check with BTF")),
        edits=(
            Edit(TRACE_PROBE_C,
                 "\treal_type = btf_type_skip_modifiers(btf, type->type, ",
                 "\t/* Only a pointer's ->type is the id of another type. */\n"
                 "\tif (!btf_type_is_ptr(type))\n\t\treturn false;\n\n"
                 "\treal_type = btf_type_skip_modifiers(btf, type->type, "),
            Edit(TRACE_PROBE_C,
                 "\treal_type = btf_type_skip_modifiers(btf, array->type, {tid});\n\n"
                 "\tintdata = btf_type_int(real_type);",
                 "\treal_type = btf_type_skip_modifiers(btf, array->type, {tid});\n"
                 "\tif (!real_type || !btf_type_is_int(real_type))\n\t\treturn false;\n\n"
                 "\tintdata = btf_type_int(real_type);"),
        ),
        notes=_notes(t, "btf-char-ptr-needs-a-pointer.patch (the btf_type_is_char_ptr() "
                     "half of this patch)", "refused with EINVAL, \"This type does not "
                     "fit for string.\""))
    test = Patch(
        subject="selftests/ftrace: Add a test of the BTF string type check",
        body=_wrap("""
Check that a kprobe event refuses :string and :ustring for a BTF
argument that is not a char pointer nor a char array ($retval of
vfs_read(), an ssize_t), with "This type does not fit for string." in
error_log, and still accepts one that is a char pointer (kstrdup()'s
s).""", """
Before the fix of btf_type_is_char_ptr(), the $retval line is accepted
where type id 8 of the vmlinux BTF is an unsigned 8-bit int (x86_64 on
Debian's 6.12 and 7.3 kernels). On a kernel whose BTF has another type
at that id it is refused with or without the fix, and the test passes
there."""),
        new_files=((f"{TC_DIR}/kprobe_btf_string_type.tc", BTF_STRING_TC),),
        notes=_notes(t, None, None, test=True))
    return [fix, test]


# -- 2. the errno of a bad symbol

TRACE_KPROBE_C = "kernel/trace/trace_kprobe.c"

SYMBOL_ERRNO_TC = """\
#!/bin/sh
# SPDX-License-Identifier: GPL-2.0
# description: Kprobe event on a missing or non-unique symbol: errno
# requires: kprobe_events dd:program

# The shell's own echo may not print the errno of a failed write (dash
# says "I/O error"); dd prints strerror() of it.
write_errno() { # command
	printf "%s" "$1" | LC_ALL=C dd of=kprobe_events conv=notrunc 2>&1 || true
}

: "A missing symbol: ENOENT"
write_errno "p:testprobe no_such_symbol_for_kprobe_test" |
	grep -q "No such file or directory"

: "A symbol of several functions: EADDRNOTAVAIL"
SYMBOL='name_show'
if [ "$(grep -c -E "[[:alnum:]]+ t ${SYMBOL}$" /proc/kallsyms)" -le '1' ]; then
	exit_unsupported
fi
write_errno "p:testprobe ${SYMBOL}" | grep -q "Cannot assign requested address"
"""


def _symbol_errno(t: Tree) -> list[Patch]:
    fn = ("trace_kprobe_create_internal" if "trace_kprobe_create_internal("
          in t.read(TRACE_KPROBE_C) else "__trace_kprobe_create")
    call = t.line_of(TRACE_KPROBE_C, "ret = validate_probe_symbol(symbol);")
    vsym = t.line_of(TRACE_KPROBE_C, "static int validate_module_probe_symbol(const char *modname, const char *symbol)")
    if fn == "__trace_kprobe_create":
        how = (f"""jumps to parse_error
(line {t.line_of(TRACE_KPROBE_C, "parse_error:")}), which sets ret = -EINVAL.""")
        old, new = ("\t\t\t\ttrace_probe_log_err(0, BAD_PROBE_ADDR);\n\t\t\tgoto parse_error;\n",
                    "\t\t\t\ttrace_probe_log_err(0, BAD_PROBE_ADDR);\n\t\t\tgoto error;\n")
        change = "Go to error instead, which keeps ret"
        since = ""
    else:
        how = "returns -EINVAL."
        old, new = ("\t\t\t\ttrace_probe_log_err(0, BAD_PROBE_ADDR);\n\t\t\treturn -EINVAL;\n",
                    "\t\t\t\ttrace_probe_log_err(0, BAD_PROBE_ADDR);\n\t\t\treturn ret;\n")
        change = "Return validate_probe_symbol()'s error instead"
        since = ("""
(Commit 927054606d08 ("tracing/kprobes: Simplify __trace_kprobe_create()
by removing gotos") replaced the jump to parse_error with this return
and kept the EINVAL.)""")
    fix = Patch(
        subject="tracing/kprobes: Fix the errno of a missing or non-unique symbol",
        body=_wrap(f"""
validate_probe_symbol() returns -ENOENT for a probe symbol that does
not exist and -EADDRNOTAVAIL for one that several functions have
(validate_module_probe_symbol(), {TRACE_KPROBE_C}:{vsym}). Before
commit 9d8616034f16 ("tracing/kprobes: Add symbol counting check when
module loads") the kprobe event parser returned these errors to the
writer of kprobe_events, as commit b022f0c7e404 ("tracing/kprobes:
Return EADDRNOTAVAIL when func matches several symbols") meant:
EADDRNOTAVAIL tells the user to put the probe on an address instead.
Since then, {fn}() (line {call}) logs NON_UNIQ_SYMBOL or
BAD_PROBE_ADDR and {how} Both writes fail with EINVAL:""", """
  # echo 'p:nonuniq c_start' >> /sys/kernel/tracing/kprobe_events
  (write error: Invalid argument; error_log: "The symbol is not unique")
  # echo 'p:missing no_such_symbol' >> /sys/kernel/tracing/kprobe_events
  (write error: Invalid argument;
   error_log: "Invalid probed address or symbol")""", since, f"""
perf_event_open() still gets both errnos: create_local_trace_kprobe()
returns validate_probe_symbol()'s error as it is. {change}: the writes
above fail with EADDRNOTAVAIL ("Cannot assign requested address") and
ENOENT ("No such file or directory") again, with the same error_log.""",
            FOUND_BY,
            _stable_tags("9d8616034f16", "tracing/kprobes: Add symbol counting check when module loads")),
        edits=(Edit(TRACE_KPROBE_C, old, new),),
        notes=_notes(t, "non-unique-symbol-eaddrnotavail.patch (EADDRNOTAVAIL for the "
                     "non-unique symbol only; the ENOENT of a missing symbol was not run)",
                     "refused with EADDRNOTAVAIL, error_log \"The symbol is not unique\"",
                     extra="The lines of the missing symbol in the message are from "
                     "reading the code; patch 2/2 checks both errnos."))
    test = Patch(
        subject="selftests/ftrace: Check the errno of a kprobe event on a bad symbol",
        body=_wrap("""
Check that a kprobe event on a symbol that does not exist fails with
ENOENT and one on a symbol that several functions have (name_show, as
in kprobe_non_uniq_symbol.tc) with EADDRNOTAVAIL. The shell's echo
does not always print the errno of a failed write (dash prints "I/O
error"), so the test writes with dd, which prints strerror() of it.""",
                   """
Without the fix of the kprobe event parser both writes fail with
EINVAL, and the test fails."""),
        new_files=((f"{TC_DIR}/kprobe_symbol_errno.tc", SYMBOL_ERRNO_TC),),
        notes=_notes(t, None, None, test=True))
    return [fix, test]


# -- 3. the return address of a call hooked by two kretprobes

KPROBES_C = "kernel/kprobes.c"

KRETPROBE_TWICE_TC = """\
#!/bin/sh
# SPDX-License-Identifier: GPL-2.0
# description: Kretprobe: two return probes on one function show the caller
# requires: kprobe_events

echo "r:testprobe1 $FUNCTION_FORK" > kprobe_events
echo "r:testprobe2 $FUNCTION_FORK" >> kprobe_events
echo 1 > events/kprobes/enable
( echo "forked" )
echo 0 > events/kprobes/enable

grep -q "testprobe1: (.* <- $FUNCTION_FORK)" trace
grep -q "testprobe2: (.* <- $FUNCTION_FORK)" trace
if grep -q "kretprobe'd" trace; then
	grep "kretprobe'd" trace
	exit_fail
fi
echo > kprobe_events
"""


def _kretprobe_twice(t: Tree) -> list[Patch]:
    handler = t.line_of(KPROBES_C, "static void kretprobe_rethook_handler(")
    old_loop = t.line_of(KPROBES_C, "ri->ret_addr = correct_ret_addr;")
    fix = Patch(
        subject="kprobes: Fix the return address of a call hooked by two kretprobes",
        body=_wrap("""
When two kretprobes hook the same call, the second one's
arch_rethook_prepare() saves the return address it finds on the stack,
which is the first one's arch_rethook_trampoline, in its
rethook_node::ret_addr. get_kretprobe_retaddr() returns that address:
kretprobe_trace_func() and kretprobe_perf_func() store it as the
event's ret_ip, which prints as "[unknown/kretprobe'd]":""", """
  # echo 'r:kra do_sys_openat2' >> /sys/kernel/tracing/kprobe_events
  # echo 'r:krb do_sys_openat2' >> /sys/kernel/tracing/kprobe_events
  # echo 1 > /sys/kernel/tracing/events/kprobes/enable
  # cat /proc/version > /dev/null; cat /sys/kernel/tracing/trace
  [...]
  kra: ([unknown/kretprobe'd] <- do_sys_openat2)
  krb: (__x64_sys_openat+0x55/0xa0 <- do_sys_openat2)""",
            f"""
(The events without their task, CPU and time columns: one of the two
prints "[unknown/kretprobe'd]" for every call.)""", f"""
The real return
address is known: rethook_trampoline_handler() finds it with
__rethook_find_ret_addr(), sets regs->ip to it and passes it to every
handler as @ret_addr. Before commit 73f9b911faa7 ("kprobes: Use rethook
for kretprobe if possible"), __kretprobe_trampoline_handler() set
ri->ret_addr to it before calling each handler ({KPROBES_C}:{old_loop},
still the code where kretprobes do not use rethook);
kretprobe_rethook_handler() (line {handler}) does not.""", """
Do the same in kretprobe_rethook_handler(): set ri->node.ret_addr to
@ret_addr before calling the handler. This fixes
get_kretprobe_retaddr() for every kretprobe user, where storing
instruction_pointer(regs) in the trace and perf records of kprobe
events would fix only those two. It is safe for rethook: after the
handlers, rethook_trampoline_handler() uses its own correct_ret_addr
and list cursor, not the nodes' ret_addr, and the nodes are recycled
right after. An unwinder running in a handler (rethook_find_ret_addr())
now finds the real address in this node where it skipped it as a
trampoline before and found the same address in the next node.""",
            FOUND_BY,
            _stable_tags("73f9b911faa7", "kprobes: Use rethook for kretprobe if possible")),
        edits=(Edit(KPROBES_C,
                    "\tri = container_of(rh, struct kretprobe_instance, node);\n"
                    "\trp->handler(ri, regs);\n",
                    "\tri = container_of(rh, struct kretprobe_instance, node);\n"
                    "\t/*\n\t * If another kretprobe hooked this call first, ri->node.ret_addr\n"
                    "\t * is its trampoline: give the handler the real return address,\n"
                    "\t * as __kretprobe_trampoline_handler() does.\n\t */\n"
                    "\tri->node.ret_addr = ret_addr;\n"
                    "\trp->handler(ri, regs);\n"),),
        notes=_notes(t, "kretprobe-ret-ip-from-regs.patch (a different fix: "
                     "instruction_pointer(regs) in the trace and perf records; this "
                     "patch fixes kretprobe_rethook_handler() instead and was not run)",
                     "both events print the caller (do_sys_open+0x2a/0x31 in the small "
                     "build)"))
    test = Patch(
        subject="selftests/ftrace: Add a test of two kretprobes on one function",
        body=_wrap("""
Put two return probes on the fork function and check that the events
of both print the caller, not "[unknown/kretprobe'd]": with rethook,
the return address of the second probe to hook a call was the first
one's trampoline.""", """
Without the fix of kretprobe_rethook_handler(), one of the two events
prints "[unknown/kretprobe'd]" for every call, and the test fails."""),
        new_files=((f"{TC_DIR}/kretprobe_same_function.tc", KRETPROBE_TWICE_TC),),
        notes=_notes(t, None, None, test=True))
    return [fix, test]


def _notes(t: Tree, verified_with: str | None, after: str | None, *, test: bool = False,
           extra: str = "") -> str:
    """What was run on a kernel for this patch and what was not (the patch's notes)."""
    if test:
        return ("Run by ftracetest -K in x86_64 guests (QEMU TCG, 2026-11-28 and 29): "
                "not ok on Debian's 6.12.117 and 7.3.4 kernels and on small builds of "
                "their sources, ok with patch 1/2 on each; every other case of "
                "test.d/kprobe and test.d/dynevent gave the same result with and without "
                "it.")
    return (f"The \"before\" output is from Debian's stock 6.12.117 kernel "
            f"(linux-image-6.12.117+deb13-cloud-amd64, x86_64, 2026-11-26). The \"after\" "
            f"behaviour ({after}) was first seen on a small build of Debian's 6.12.117 "
            f"source with {verified_with}. This patch, in this {t.series} version and the "
            f"{_other_series(t.series)} one, was then built into small builds of Debian's "
            f"6.12.117 and 7.3.4 sources and run (x86_64 under QEMU TCG, 2026-11-28 and "
            f"29): the reproducing commands above show the bug on Debian's kernel and on "
            f"the unpatched build and not with this patch, and the test of patch 2/2 "
            f"fails without it and passes with it." + (f" {extra}" if extra else ""))


def _other_series(series: str) -> str:
    """The series a patch has its other version for (:data:`SERIES` holds two)."""
    return next(s for s in SERIES if s != series)


FINDINGS: dict[str, Finding] = {f.name: f for f in (
    Finding("btf-char-ptr", 1, "btf_type_is_char_ptr() takes a non-pointer's size for a type id",
            _btf_char_ptr),
    Finding("non-unique-symbol-errno", 2, "a missing or non-unique symbol is refused with EINVAL",
            _symbol_errno),
    Finding("second-kretprobe-ret-ip", 3, "a second return probe on one call prints "
            "[unknown/kretprobe'd]", _kretprobe_twice),
)}


def finding(name: str) -> Finding:
    """A finding by its scenario name or its number in docs/upstream.md."""
    for f in FINDINGS.values():
        if name in (f.name, str(f.number)):
            return f
    raise SetupError(f"no finding {name!r}", "name one of: " + ", ".join(
        f"{f.number} ({f.name})" for f in FINDINGS.values()))


# ---------------------------------------------------------------- git


def git(repo: Path | None, *args: str, env: dict[str, str] | None = None, input: str | None = None,
        cwd: Path | None = None, check: bool = True) -> str:
    cmd = ["git"] + ([f"--git-dir={repo}"] if repo else []) + list(args)
    e = {**os.environ, **(env or {})}
    p = subprocess.run(cmd, input=input, capture_output=True, text=True, env=e, cwd=cwd)
    if check and p.returncode:
        raise SetupError(f"`{' '.join(cmd[:6])}` failed: {p.stderr.strip()[-400:]}",
                         "see the git error above")
    return p.stdout


def identity() -> tuple[str, str]:
    """``git config user.name`` and ``user.email`` of the user's environment.

    :raise SetupError: either is unset (never an invented identity)."""
    vals = []
    for key in ("user.name", "user.email"):
        p = subprocess.run(["git", "config", "--get", key], capture_output=True, text=True,
                           cwd=Path.home())
        vals.append(p.stdout.strip())
    if not all(vals):
        raise SetupError("no git identity: the patches' author is `git config user.name` and "
                         "`user.email`, and one is unset",
                         "git config --global user.name 'Your Name'; "
                         "git config --global user.email you@example.org")
    return vals[0], vals[1]


def _ident_env() -> dict[str, str]:
    """The author and committer of every commit the export makes: the user's identity."""
    name, email = identity()
    return {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_COMMITTER_NAME": name,
            "GIT_COMMITTER_EMAIL": email}


def repo_dir() -> Path:
    return cache_dir() / "upstream" / "linux.git"


def _ref(version: str) -> str:
    return "refs/heads/debian/" + re.sub(r"[^A-Za-z0-9._+-]", "_", version)


def find_source(series: str, progress: Progress | None = None) -> Path:
    """Debian's unpacked ``linux-source-<series>`` (the newest in the cache), fetched if
    there is none (``kph kernel fetch SERIES``)."""
    if series not in SERIES:
        raise SetupError(f"--tree {series}: the series are made for {', '.join(SERIES)}",
                         "pass --tree 6.12 or --tree 7.3")
    have = ksource.unpacked_sources(series)
    return have[-1] if have else ksource.fetch_source(series, progress)


def base_tree(series: str, progress: Progress | None = None) -> Tree:
    """The git copy's base commit of Debian's ``series`` tree, made once (``git add`` of
    the whole tree into ``repo_dir()``, a commit "Debian linux-source-<version>")."""
    from ..procs import lock_file

    say = progress or (lambda s: None)
    src = find_source(series, progress)
    version = src.name[len("linux-source-"):]
    repo = repo_dir()
    repo.parent.mkdir(parents=True, exist_ok=True)
    fd = lock_file(repo.parent / ".linux.git.lock", LOCK_TIMEOUT,
                   "another kph is making the git copy: wait for it")
    try:
        if not (repo / "HEAD").is_file():
            git(None, "init", "-q", "--bare", str(repo))
            git(repo, "config", "gc.auto", "0")      # git am must not repack 0.6 GB a tree
        ref = _ref(version)
        base = git(repo, "rev-parse", "-q", "--verify", ref, check=False).strip()
        if not base:
            base = _commit_tree(repo, src, version, say)
            git(repo, "update-ref", ref, base)
    finally:
        os.close(fd)
    return Tree(series, src, version, repo, base)


def _commit_tree(repo: Path, src: Path, version: str, say: Progress) -> str:
    say(f"upstream: making the git copy of linux-source-{version} (once; about 1.5 min)")
    index = repo / f"index-{os.getpid()}"
    env = {"GIT_INDEX_FILE": str(index), "GIT_WORK_TREE": str(src)}
    try:
        # the tree as Debian ships it: not the build directory kph makes inside it
        git(repo, "-c", "core.bare=false", "-c", "core.fsync=none", "add", "-A", "-f", ".",
            f":(exclude){ksource.BUILD_SUBDIR}", env=env, cwd=src)
        tree = git(repo, "write-tree", env=env).strip()
    finally:
        index.unlink(missing_ok=True)
    return git(repo, "commit-tree", tree, "-m", f"Debian linux-source-{version}",
               env=_ident_env()).strip()


def _apply(t: Tree, parent: str, patch: Patch) -> str:
    """``patch`` committed on ``parent`` without a work tree; the commit's id."""
    files: dict[str, str] = {}
    for e in patch.edits:
        text = files.get(e.path)
        if text is None:
            text = git(t.repo, "show", f"{parent}:{e.path}")
        old, new = e.old, e.new
        if "{tid}" in old:      # 6.12 passes &tid to btf_type_skip_modifiers(), 7.3 NULL
            tid = "&tid" if old.replace("{tid}", "&tid") in text else "NULL"
            old, new = old.replace("{tid}", tid), new.replace("{tid}", tid)
        if text.count(old) != 1:
            raise SetupError(f"{e.path} of linux-source-{t.version}: the code the fix "
                             f"changes is found {text.count(old)} times, not once",
                             "the tree is not what the export knows; see harness/apps/upstream.py")
        files[e.path] = text.replace(old, new)
    for path, text in patch.new_files:
        files[path] = text
    index = t.repo / f"index-{os.getpid()}"
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        git(t.repo, "read-tree", parent, env=env)
        for path, text in files.items():
            blob = git(t.repo, "hash-object", "-w", "--stdin", input=text).strip()
            git(t.repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{path}", env=env)
        tree = git(t.repo, "write-tree", env=env).strip()
    finally:
        index.unlink(missing_ok=True)
    ident = _ident_env()
    commit = git(t.repo, "commit-tree", tree, "-p", parent, "-F", "-",
                 input=f"{patch.subject}\n\n{patch.body}\n", env=ident).strip()
    if patch.notes:
        git(t.repo, "notes", "add", "-f", "-m",
            textwrap.fill(patch.notes, 72, break_on_hyphens=False), commit, env=ident)
    return commit


# ---------------------------------------------------------------- checks


@dataclass
class Checkpatch:
    patch: Path
    errors: int
    warnings: int
    checks: int
    types: list[str]            # each message's type (--show-types), in order
    output: str

    def clean(self, accepted: set[str]) -> bool:
        return set(self.types) <= accepted


def checkpatch(t: Tree, patch: Path) -> Checkpatch:
    """The tree's ``scripts/checkpatch.pl --strict --show-types`` on ``patch``, run from the
    unpacked tree (no .git there: the Fixes: ids are not looked up in a history)."""
    p = subprocess.run(["perl", "scripts/checkpatch.pl", "--strict", "--show-types",
                        "--color=never", str(patch)],
                       capture_output=True, text=True, cwd=t.src,
                       env={**os.environ, "GIT_DIR": str(t.src / ".no-git")})
    m = re.search(r"total: (\d+) errors, (\d+) warnings, (\d+) checks", p.stdout)
    if not m:
        raise SetupError(f"checkpatch.pl gave no totals for {patch.name}: {p.stderr.strip()[-300:]}",
                         "run it by hand: perl scripts/checkpatch.pl --strict PATCH")
    types = re.findall(r"^(?:ERROR|WARNING|CHECK):([A-Z0-9_]+):", p.stdout, re.M)
    return Checkpatch(patch, int(m[1]), int(m[2]), int(m[3]), types, p.stdout)


def verify_am(t: Tree, patches: list[Path]) -> str:
    """``git am`` of ``patches`` onto a fresh checkout of the base commit (a shared clone
    of the git copy, sparse: the directories the patches touch); ``git log --oneline`` of
    what it applied.

    :raise SetupError: the checkout is not clean, or ``git am`` fails."""
    dirs = sorted({str(Path(p).parent) for f in patches for p in
                   re.findall(r"^diff --git a/(\S+) ", f.read_text(), re.M)})
    with tempfile.TemporaryDirectory(prefix="kph-am-") as d:
        wt = Path(d) / "linux"
        git(None, "clone", "-q", "--shared", "--no-checkout", str(t.repo), str(wt))
        w = ["-C", str(wt)]
        git(None, *w, "sparse-checkout", "set", "--cone", *dirs)
        git(None, *w, "checkout", "-q", "-b", "am-check", t.base)
        if git(None, *w, "status", "--porcelain").strip():
            raise SetupError(f"the checkout of {t.base[:12]} is not clean", "report it")
        name, email = identity()
        p = subprocess.run(["git", *w, "-c", f"user.name={name}", "-c", f"user.email={email}",
                            "am", "-q", *map(str, patches)], capture_output=True, text=True)
        if p.returncode:
            raise SetupError(f"git am of the series on linux-source-{t.version} failed: "
                             f"{(p.stdout + p.stderr).strip()[-400:]}", "see above")
        return git(None, *w, "log", "--oneline", f"{t.base}..HEAD")


# ---------------------------------------------------------------- export


@dataclass
class Export:
    finding: Finding
    tree: Tree
    branch: str
    patches: list[Path]
    subjects: list[str]
    checkpatch: list[Checkpatch] = field(default_factory=list)
    accepted: set[str] = field(default_factory=set)
    applied: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.applied) and all(c.clean(self.accepted) for c in self.checkpatch)


def default_out(name: str, series: str) -> Path:
    return cache_dir() / "upstream" / "series" / f"{name}-{series}"


def export(name: str, series: str = "6.12", out: str | os.PathLike[str] | None = None, *,
           signoff: bool = False, check: bool = True, progress: Progress | None = None) -> Export:
    """Write the ``git format-patch`` series of finding ``name`` against Debian's
    ``series`` tree into ``out`` (emptied of ``*.patch`` first), then check it
    (``check``): checkpatch.pl --strict on each patch and ``git am`` on a clean checkout.

    :raise SetupError: no git identity, no tree, a tree the edits do not fit, git failing."""
    f = finding(name)
    identity()
    t = base_tree(series, progress)
    commit = t.base
    subjects = []
    for p in f.build(t):
        commit = _apply(t, commit, p)
        subjects.append(p.subject)
    branch = f"kph/{f.name}/{series}"
    git(t.repo, "update-ref", f"refs/heads/{branch}", commit)
    dest = (Path(out) if out else default_out(f.name, series)).resolve()   # checkpatch runs in the tree
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.patch"):
        old.unlink()
    args = ["-c", "core.abbrev=12", "format-patch", "-q", "--notes", "-o", str(dest), f"{t.base}..{commit}"]
    if signoff:
        args.insert(3, "--signoff")
    name_, email = identity()
    patches = [Path(x) for x in git(t.repo, "-c", f"user.name={name_}", "-c",
                                     f"user.email={email}", *args).split()]
    if not patches:
        patches = sorted(dest.glob("*.patch"))
    e = Export(f, t, branch, patches, subjects)
    e.accepted = ({ACCEPTED_NEW_FILE, ACCEPTED_NO_HISTORY}
                  | (set() if signoff else {ACCEPTED_NO_SIGNOFF}))
    if check:
        e.checkpatch = [checkpatch(t, p) for p in patches]
        e.applied = verify_am(t, patches)
    return e


def tool_available() -> str | None:
    """Why the export cannot run here (no git, no perl), or None."""
    missing = [x for x in ("git", "perl") if shutil.which(x) is None]
    return f"{' and '.join(missing)} not found" if missing else None
