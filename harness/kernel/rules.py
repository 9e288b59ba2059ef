"""The probe-event rules of each kernel series the harness boots: 6.1, 6.12, 7.3.

Why data: the grammar of ``kprobe_events``/``uprobe_events``, its ``error_log`` texts, its
types and limits, and some host-side semantics changed between these kernels. The parser
(:mod:`harness.kernel.grammar`: ``common`` for 6.1, ``args`` for 6.12 and 7.3), the trace layer
(:mod:`harness.backends.tracelayer`) and the fetch evaluation (:mod:`harness.kernel.grammar.fetch`)
ask a :class:`KernelRules` instead of assuming one kernel. Each difference is a field here,
with the source it was read from (``file: function`` of that version, from Debian's
``linux-source-<series>`` package) in :data:`SOURCES`, and each was checked in that
version's booted guest (``tests/vm/test_rules.py``: ``error_log`` text and caret,
``/sys/kernel/debug/kprobes/list``, recorded events).

The series of a kernel comes from its release (``uname -r``, the image's facts). A series
between two known ones gets the older one's rules and a warning: the newer rules may hold
things it does not have.

The ``ERRORS`` lists (kernel/trace/trace_probe.h) are kept whole per series: 61 messages in
6.1, 79 in 6.12, 89 in 7.3.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Mapping

log = logging.getLogger(__name__)

__all__ = ["KernelRules", "rules_for", "series_of_release", "SERIES", "SOURCES", "ERRORS"]

#: kernel/trace/trace_probe.h: ERRORS of Linux 6.1 (6.1.192), in the kernel's order.
_ERRORS_6_1 = {
    "FILE_NOT_FOUND": "Failed to find the given file",
    "NO_REGULAR_FILE": "Not a regular file",
    "BAD_REFCNT": "Invalid reference counter offset",
    "REFCNT_OPEN_BRACE": "Reference counter brace is not closed",
    "BAD_REFCNT_SUFFIX": "Reference counter has wrong suffix",
    "BAD_UPROBE_OFFS": "Invalid uprobe offset",
    "MAXACT_NO_KPROBE": "Maxactive is not for kprobe",
    "BAD_MAXACT": "Invalid maxactive number",
    "MAXACT_TOO_BIG": "Maxactive is too big",
    "BAD_PROBE_ADDR": "Invalid probed address or symbol",
    "NON_UNIQ_SYMBOL": "The symbol is not unique",
    "BAD_RETPROBE": "Retprobe address must be an function entry",
    "BAD_ADDR_SUFFIX": "Invalid probed address suffix",
    "NO_GROUP_NAME": "Group name is not specified",
    "GROUP_TOO_LONG": "Group name is too long",
    "BAD_GROUP_NAME": "Group name must follow the same rules as C identifiers",
    "NO_EVENT_NAME": "Event name is not specified",
    "EVENT_TOO_LONG": "Event name is too long",
    "BAD_EVENT_NAME": "Event name must follow the same rules as C identifiers",
    "EVENT_EXIST": "Given group/event name is already used by another event",
    "RETVAL_ON_PROBE": "$retval is not available on probe",
    "BAD_STACK_NUM": "Invalid stack number",
    "BAD_ARG_NUM": "Invalid argument number",
    "BAD_VAR": "Invalid $-variable specified",
    "BAD_REG_NAME": "Invalid register name",
    "BAD_MEM_ADDR": "Invalid memory address",
    "BAD_IMM": "Invalid immediate value",
    "IMMSTR_NO_CLOSE": "String is not closed with '\"'",
    "FILE_ON_KPROBE": "File offset is not available with kprobe",
    "BAD_FILE_OFFS": "Invalid file offset value",
    "SYM_ON_UPROBE": "Symbol is not available with uprobe",
    "TOO_MANY_OPS": "Dereference is too much nested",
    "DEREF_NEED_BRACE": "Dereference needs a brace",
    "BAD_DEREF_OFFS": "Invalid dereference offset",
    "DEREF_OPEN_BRACE": "Dereference brace is not closed",
    "COMM_CANT_DEREF": "$comm can not be dereferenced",
    "BAD_FETCH_ARG": "Invalid fetch argument",
    "ARRAY_NO_CLOSE": "Array is not closed",
    "BAD_ARRAY_SUFFIX": "Array has wrong suffix",
    "BAD_ARRAY_NUM": "Invalid array size",
    "ARRAY_TOO_BIG": "Array number is too big",
    "BAD_TYPE": "Unknown type is specified",
    "BAD_STRING": "String accepts only memory argument",
    "BAD_SYMSTRING": "Symbol String doesn't accept data/userdata",
    "BAD_BITFIELD": "Invalid bitfield",
    "ARG_NAME_TOO_LONG": "Argument name is too long",
    "NO_ARG_NAME": "Argument name is not specified",
    "BAD_ARG_NAME": "Argument name must follow the same rules as C identifiers",
    "USED_ARG_NAME": "This argument name is already used",
    "ARG_TOO_LONG": "Argument expression is too long",
    "NO_ARG_BODY": "No argument expression",
    "BAD_INSN_BNDRY": "Probe point is not an instruction boundary",
    "FAIL_REG_PROBE": "Failed to register probe event",
    "DIFF_PROBE_TYPE": "Probe type is different from existing probe",
    "DIFF_ARG_TYPE": "Argument type or name is different from existing probe",
    "SAME_PROBE": "There is already the exact same probe event",
    "NO_EVENT_INFO": "This requires both group and event name to attach",
    "BAD_ATTACH_EVENT": "Attached event does not exist",
    "BAD_ATTACH_ARG": "Attached event does not have this field",
    "NO_EP_FILTER": "No filter rule after 'if'",
    "EVENT_TOO_BIG": "Event too big (too many fields?)",
}

#: 6.12 (6.12.117): MAXACT_NO_KPROBE became BAD_MAXACT_TYPE (fprobe events share the
#: check), and 18 more came with fprobe/tracepoint events and BTF arguments.
_ERRORS_6_12 = {k: v for k, v in _ERRORS_6_1.items() if k != "MAXACT_NO_KPROBE"} | {
    "BAD_MAXACT_TYPE": "Maxactive is only for function exit",
    "NO_TRACEPOINT": "Tracepoint is not found",
    "BAD_TP_NAME": "Invalid character in tracepoint name",
    "NO_RETVAL": "This function returns 'void' type",
    "NOSUP_BTFARG": "BTF is not available or not supported",
    "NO_BTFARG": "This variable is not found at this probe point",
    "NO_BTF_ENTRY": "No BTF entry for this probe point",
    "BAD_VAR_ARGS": "$arg* must be an independent parameter without name etc.",
    "NOFENTRY_ARGS": "$arg* can be used only on function entry or exit",
    "DOUBLE_ARGS": "$arg* can be used only once in the parameters",
    "ARGS_2LONG": "$arg* failed because the argument list is too long",
    "ARGIDX_2BIG": "$argN index is too big",
    "NO_PTR_STRCT": "This is not a pointer to union/structure.",
    "NOSUP_DAT_ARG": "Non pointer structure/union argument is not supported.",
    "BAD_HYPHEN": "Failed to parse single hyphen. Forgot '>'?",
    "NO_BTF_FIELD": "This field is not found.",
    "BAD_BTF_TID": "Failed to get BTF type info.",
    "BAD_TYPE4STR": "This type does not fit for string.",
    "NEED_STRING_TYPE": "$comm and immediate-string only accepts string type",
}

#: 7.3 (7.3.4): typecasts, per-cpu access, nesting and argument-count errors; the
#: FILE_ON_KPROBE text changed (the list is sorted by name there).
_ERRORS_7_3 = _ERRORS_6_12 | {
    "FILE_ON_KPROBE": "File offset is not available for kernel probes",
    "NOSUP_PERCPU": "Per-cpu variable access is only for kernel probes",
    "NO_EVENT_FIELD": "This event field is not found.",
    "TOO_MANY_ARGS": "Too many arguments are specified",
    "TOO_MANY_EARGS": "Too many entry arguments specified",
    "TOO_MANY_NESTED": "Too many nested typecasts/dereferences",
    "TYPECAST_BAD_ARROW": "Typecast field option does not support -> operator",
    "TYPECAST_NOT_ALIGNED": "Typecast field option is not byte-aligned",
    "TYPECAST_NOT_EVENT": "Typecasts are only for eprobe fields",
    "TYPECAST_REQ_FIELD": "Typecast requires a field access",
    "TYPECAST_SYM_OFFSET": "@SYM+/-OFFSET with typecast needs parentheses",
}

ERRORS: Mapping[str, Mapping[str, str]] = {"6.1": _ERRORS_6_1, "6.12": _ERRORS_6_12,
                                           "7.3": _ERRORS_7_3}

_BASE_TYPES = frozenset(("string", "ustring", "symstr", "u8", "u16", "u32", "u64", "s8", "s16",
                         "s32", "s64", "x8", "x16", "x32", "x64", "symbol"))


@dataclass(frozen=True)
class KernelRules:
    """What one kernel series does with probe definitions. Field docs say what each
    value means; :data:`SOURCES` says where it was read, per series."""

    series: str
    errors: Mapping[str, str]
    #: which argument parser: "6.1" (``traceprobe_parse_probe_arg()`` with flags, in
    #: :mod:`harness.kernel.grammar.common`) or "context" (6.4+: a ``traceprobe_parse_context``, in
    #: :mod:`harness.kernel.grammar.args`)
    arg_parser: str
    #: the error a digit after ``p`` gets (``p100 vfs_read``): its ERRORS name
    maxact_on_kprobe: str
    #: ``probe_fetch_types[]``: the type names ``:TYPE`` may give (``b<w>@<o>/<s>`` aside)
    fetch_types: frozenset[str]
    #: ``MAX_ARGSTR_LEN``: the longest argument body
    max_argstr_len: int
    #: more than ``MAX_TRACE_ARGS`` (128) arguments: "ignore" the rest (6.1), "E2BIG"
    #: without a log entry (6.12), or "TOO_MANY_ARGS" logged at the first argument (7.3)
    too_many_args: str
    #: where ``__trace_kprobe_create()`` counts ``SYM`` in kallsyms: "after_retprobe"
    #: (6.1: after the return-probe check, unqualified names only, -ENOENT/-EADDRNOTAVAIL)
    #: or "validate" (6.12+: ``validate_probe_symbol()`` first, ``MOD:SYM`` too when the
    #: module is loaded, a parse error: -EINVAL)
    symbol_check: str
    #: ``number_of_same_symbols()`` stops at vmlinux when it has the name (7.3): a module's
    #: same-named function no longer makes ``SYM`` ambiguous
    symbols_vmlinux_first: bool
    #: a return probe on a function entry is also ``TPARG_FL_FENTRY`` (6.1; then ``$argN``
    #: is refused on it); 6.12+ sets FENTRY for entry probes only and reads ``$argN`` of a
    #: return probe from data its entry handler stored (``FETCH_OP_EDATA``)
    fentry_on_return: bool
    entry_args_on_return: bool
    #: BTF arguments: names, ``->``/``.`` fields, ``$arg*``, ``$argN`` renamed to the BTF
    #: name, ``$retval`` typed from the prototype (with ``CONFIG_PROBE_EVENTS_BTF_ARGS``)
    btf_args: bool
    #: ``%pd``/``%pD`` rewritten into dentry/file name fetches
    dentry_types: bool
    #: ``$comm:x64`` and ``$comm[2]`` are logged (NEED_STRING_TYPE); 6.1 fails silently
    comm_type_logged: bool
    #: ``$current``, ``this_cpu_read()``/``this_cpu_ptr()``, ``(struct[,field])`` casts, and
    #: the non-recursive argument parser with its nesting limit
    current_var: bool
    this_cpu: bool
    typecasts: bool
    max_nested: int | None
    #: uprobe lines refuse ``symbol``/``symstr`` (``find_fetch_type()`` with TPARG_FL_USER)
    uprobe_no_symbol_types: bool
    #: probe kinds ``dynamic_events`` takes besides p, r and uprobe lines
    dynevent_kinds: tuple[str, ...]
    #: a 64-bit process returns into the uretprobe syscall trampoline (6.11+), which
    #: pushes rax, rcx and r11 below the returned-to stack pointer before the handlers run
    #: and leaves r11, rcx and the return address there; 6.1's trampoline is one int3
    uretprobe_syscall: bool = False
    #: fprobe events (``f`` lines): "" none (6.1); "rethook" (6.12: ``f[N]`` sets the exit
    #: instance pool, default 2 * possible CPUs per matched function, exits through
    #: ``arch_rethook_trampoline``); "fgraph" (7.3: no MAXACTIVE, exits through the
    #: function-graph return stack, no pool)
    fprobe: str = ""
    #: the ``error_log`` entry a ``%REG`` argument of an fprobe leaves last
    fprobe_reg_error: str = "BAD_VAR"
    #: an fprobe whose filter matches no ftrace location: ``register_fprobe()`` fails and
    #: ``trace_fprobe_create_internal()`` logs this (6.12 -EINVAL: FAIL_REG_PROBE; 7.3
    #: -ENOENT: BAD_PROBE_ADDR); the write fails with EINVAL either way
    fprobe_no_match: str = "FAIL_REG_PROBE"
    #: an fprobe refused at registration (an existing event of another type or other
    #: arguments, the same probe) fails the write with this errno instead of the
    #: registration's (7.3 returns -EINVAL whatever register_trace_fprobe_event() said;
    #: 6.12 keeps its -EEXIST); None: the registration's
    fprobe_register_errno: int | None = None
    #: the fprobe itself is registered when its event is first enabled, not when the line
    #: is written (7.3: ``enable_trace_fprobe()`` calls ``__register_trace_fprobe()``, which
    #: resolves ``@SYM`` arguments with ``traceprobe_update_arg()``): an unknown ``@SYM``
    #: fails the enable with -ENOENT and logs nothing; 6.12 resolves it at the write
    #: (``register_trace_fprobe()``), logging BAD_PROBE_ADDR at the target
    fprobe_register_at_enable: bool = False
    #: the most entry data an ``f ...%return`` line's entry arguments may need (one
    #: ``unsigned long`` per argument saved at entry, ``traceprobe_get_entry_data_size()``):
    #: more is TOO_MANY_EARGS at the first argument, -E2BIG (7.3: MAX_FPROBE_DATA_SIZE,
    #: 15 words); None: no limit at parse time (6.12's rethook takes any size)
    fprobe_max_entry_data: int | None = None
    #: include/linux/preempt.h: HARDIRQ_SHIFT, where the 4 hardirq bits of
    #: preempt_count() start (NMI's follow): 16 up to 6.x; 24 in 7.3, whose 8
    #: HARDIRQ_DISABLE bits come first (and whose x86 preempt_count is an unsigned long)
    preempt_hardirq_shift: int = 16
    #: a tracepoint probe on a tracepoint another ``t`` event already probes fails with
    #: -EEXIST and no error_log entry (6.12: ``__regsiter_tracepoint_fprobe()`` puts the
    #: same stub on the tracepoint again, ``tracepoint_probe_register_prio_may_exist()``
    #: refuses it; 7.3 puts it once for all of them)
    tprobe_stub_once: bool = False
    #: event probes (``e`` lines) host-side: "" not mirrored (6.1); "dollar" (6.12: an
    #: event field is ``$FIELD`` only, a bare name is a BTF argument: NOSUP_BTFARG);
    #: "bare" (7.3: ``FIELD`` or ``$FIELD``, an unknown bare name NO_EVENT_FIELD, and a
    #: typecast may take a field: ``(STRUCT)FIELD->MEMBER``)
    eprobe: str = ""
    #: a ``dynamic_events`` line no kind takes (every ``*_create()`` returned -ECANCELED:
    #: an ``f``, ``t`` or ``e`` head alone) is EINVAL; 7.3 logs "No matching dynamic
    #: event type" against it at 0, 6.12 logs nothing
    dynevent_no_match_logged: bool = False
    #: the data_loc length an empty user string stores through
    #: ``strncpy_from_user_nofault()`` (``ustring``, and ``string`` below TASK_SIZE): 0
    #: (printed ``(fault)``) up to 6.12, 1 (printed ``""``) in 7.3, which counts the NUL of
    #: an empty string too
    empty_user_string_len: int = 0
    #: x86 ``can_probe()`` refuses a probe on INT3, INT n, INTO, INT1, UD0, UD1 or UD2
    #: (``is_exception_insn()``) with -EILSEQ, before ``__copy_instruction()`` would
    #: refuse an INT3 with -EINVAL (6.12, 7.3; 6.1 has no such check: EINVAL, measured
    #: with a raw kprobe on ``__cpuidle_text_end``, an INT3 of padding)
    can_probe_exception_insns: bool = False

    def message(self, code: str) -> str:
        """The ``error_log`` text of ``code`` on this kernel.

        :raise KeyError: when this kernel has no such error (a parser bug).
        """
        return self.errors[code]

    def has_type(self, name: str) -> bool:
        return name in self.fetch_types


_6_1 = KernelRules(
    series="6.1", errors=_ERRORS_6_1, arg_parser="6.1", maxact_on_kprobe="MAXACT_NO_KPROBE",
    fetch_types=_BASE_TYPES, max_argstr_len=63, too_many_args="ignore",
    symbol_check="after_retprobe", symbols_vmlinux_first=False,
    fentry_on_return=True, entry_args_on_return=False, btf_args=False, dentry_types=False,
    comm_type_logged=False, current_var=False, this_cpu=False, typecasts=False,
    max_nested=None, uprobe_no_symbol_types=False, dynevent_kinds=())

_6_12 = KernelRules(
    series="6.12", errors=_ERRORS_6_12, arg_parser="context", maxact_on_kprobe="BAD_MAXACT_TYPE",
    fetch_types=_BASE_TYPES | {"char"}, max_argstr_len=63, too_many_args="E2BIG",
    symbol_check="validate", symbols_vmlinux_first=False,
    fentry_on_return=False, entry_args_on_return=True, btf_args=True, dentry_types=True,
    comm_type_logged=True, current_var=False, this_cpu=False, typecasts=False,
    max_nested=None, uprobe_no_symbol_types=True, dynevent_kinds=("f", "t"),
    uretprobe_syscall=True, fprobe="rethook", fprobe_reg_error="BAD_FETCH_ARG",
    fprobe_no_match="FAIL_REG_PROBE", tprobe_stub_once=True, eprobe="dollar",
    can_probe_exception_insns=True)

_7_3 = KernelRules(
    series="7.3", errors=_ERRORS_7_3, arg_parser="context", maxact_on_kprobe="BAD_MAXACT_TYPE",
    fetch_types=_BASE_TYPES | {"char"}, max_argstr_len=255, too_many_args="TOO_MANY_ARGS",
    symbol_check="validate", symbols_vmlinux_first=True,
    fentry_on_return=False, entry_args_on_return=True, btf_args=True, dentry_types=True,
    comm_type_logged=True, current_var=True, this_cpu=True, typecasts=True,
    max_nested=8, uprobe_no_symbol_types=True, dynevent_kinds=("f", "t"),
    uretprobe_syscall=True, fprobe="fgraph", fprobe_reg_error="BAD_VAR",
    fprobe_no_match="BAD_PROBE_ADDR", fprobe_register_errno=22, eprobe="bare",
    fprobe_register_at_enable=True, fprobe_max_entry_data=15 * 8, preempt_hardirq_shift=24,
    dynevent_no_match_logged=True, empty_user_string_len=1, can_probe_exception_insns=True)

SERIES: Mapping[str, KernelRules] = {"6.1": _6_1, "6.12": _6_12, "7.3": _7_3}

#: Where each field was read, per series (paths in that series' linux-source tree).
SOURCES: Mapping[str, Mapping[str, str]] = {
    "6.1": {
        "errors": "kernel/trace/trace_probe.h: ERRORS",
        "arg_parser": "kernel/trace/trace_probe.c: traceprobe_parse_probe_arg(tp, i, arg, "
                      "flags)",
        "maxact_on_kprobe": "kernel/trace/trace_kprobe.c: __trace_kprobe_create()",
        "fetch_types": "kernel/trace/trace_probe.c: probe_fetch_types[]",
        "max_argstr_len": "kernel/trace/trace_probe.h: MAX_ARGSTR_LEN",
        "too_many_args": "kernel/trace/trace_kprobe.c: __trace_kprobe_create() "
                         "(i < MAX_TRACE_ARGS)",
        "symbol_check": "kernel/trace/trace_kprobe.c: __trace_kprobe_create(), "
                        "number_of_same_symbols()",
        "fentry_on_return": "kernel/trace/trace_kprobe.c: __trace_kprobe_create() "
                            "(kprobe_on_func_entry() == 0: TPARG_FL_FENTRY)",
        "btf_args": "kernel/trace/trace_probe.c: parse_probe_arg() (no BTF variables)",
        "comm_type_logged": "kernel/trace/trace_probe.c: traceprobe_parse_probe_arg_body()",
        "uretprobe_syscall": "kernel/events/uprobes.c: __create_xol_area() (the "
                             "trampoline slot is one UPROBE_SWBP_INSN)",
    },
    "6.12": {
        "errors": "kernel/trace/trace_probe.h: ERRORS",
        "fprobe": "kernel/trace/trace_fprobe.c: __trace_fprobe_create(); kernel/trace/fprobe.c: fprobe_init_rethook(), fprobe_exit_handler()",
        "fprobe_reg_error": "kernel/trace/trace_probe.c: parse_probe_arg() (case '%': BAD_VAR, then BAD_FETCH_ARG)",
        "fprobe_no_match": "kernel/trace/trace_fprobe.c: __trace_fprobe_create() (register_trace_fprobe() -EINVAL)",
        "eprobe": "kernel/trace/trace_eprobe.c: __trace_eprobe_create(), "
                  "trace_eprobe_tp_update_arg(); trace_probe.c: parse_probe_vars() "
                  "(TPARG_FL_TEVENT), parse_trace_event_arg()",
        "tprobe_stub_once": "kernel/trace/trace_fprobe.c: __regsiter_tracepoint_fprobe(); "
                            "kernel/tracepoint.c: tracepoint_add_func() (-EEXIST)",
        "arg_parser": "kernel/trace/trace_probe.c: traceprobe_parse_probe_arg(tp, i, arg, "
                      "ctx), traceprobe_parse_probe_arg_body(), parse_probe_arg()",
        "maxact_on_kprobe": "kernel/trace/trace_kprobe.c: __trace_kprobe_create()",
        "fetch_types": "kernel/trace/trace_probe.c: probe_fetch_types[] (char)",
        "max_argstr_len": "kernel/trace/trace_probe.h: MAX_ARGSTR_LEN",
        "too_many_args": "kernel/trace/trace_kprobe.c: __trace_kprobe_create() "
                         "(argc > MAX_TRACE_ARGS: -E2BIG)",
        "symbol_check": "kernel/trace/trace_kprobe.c: validate_probe_symbol(), "
                        "validate_module_probe_symbol()",
        "fentry_on_return": "kernel/trace/trace_kprobe.c: __trace_kprobe_create() "
                            "(ret == 0 && !is_return)",
        "entry_args_on_return": "kernel/trace/trace_probe.c: parse_probe_vars(), "
                                "__store_entry_arg(); trace_kprobe.c: trace_kprobe_entry_handler()",
        "btf_args": "kernel/trace/trace_probe.c: parse_btf_arg(), parse_btf_field(), "
                    "traceprobe_expand_meta_args(), find_fetch_type_from_btf_type(); "
                    "kernel/trace/trace_btf.c: btf_find_func_proto()",
        "dentry_types": "kernel/trace/trace_probe.c: traceprobe_expand_dentry_args()",
        "comm_type_logged": "kernel/trace/trace_probe.c: parse_probe_arg_type()",
        "uprobe_no_symbol_types": "kernel/trace/trace_probe.c: find_fetch_type()",
        "dynevent_kinds": "kernel/trace/trace_fprobe.c: trace_fprobe_create_internal()",
        "uretprobe_syscall": "arch/x86/kernel/uprobes.c: uretprobe_trampoline_entry, "
                             "arch_uretprobe_trampoline(), SYSCALL_DEFINE0(uretprobe)",
    },
    "7.3": {
        "errors": "kernel/trace/trace_probe.h: ERRORS",
        "fprobe": "kernel/trace/trace_fprobe.c: trace_fprobe_create_internal(); kernel/trace/fprobe.c: fprobe_fgraph_entry(), fprobe_return()",
        "fprobe_reg_error": "kernel/trace/trace_probe.c: parse_probe_arg() (parse_probe_arg_register(): BAD_VAR)",
        "fprobe_no_match": "kernel/trace/trace_fprobe.c: trace_fprobe_create_internal() (register_trace_fprobe_event() -ENOENT)",
        "dynevent_no_match_logged": "kernel/trace/trace_dynevent.c: create_dyn_event() "
                                    "(tracing_log_err(NULL, \"dynevent\", ...))",
        "eprobe": "kernel/trace/trace_eprobe.c: trace_eprobe_create_internal(); "
                  "trace_probe.c: parse_probe_arg_default(), parse_trace_event(), "
                  "handle_typecast() (tparg_is_event_probe())",
        "fprobe_register_errno": "kernel/trace/trace_fprobe.c: trace_fprobe_create_internal() "
                                 "(return -EINVAL after register_trace_fprobe_event())",
        "empty_user_string_len": "mm/maccess.c: strncpy_from_user_nofault() (ret >= 0: "
                                 "ret++; 6.12's is ret > 0)",
        "fprobe_register_at_enable": "kernel/trace/trace_fprobe.c: enable_trace_fprobe() -> "
                                     "__register_trace_fprobe() -> traceprobe_update_arg()",
        "preempt_hardirq_shift": "include/linux/preempt.h: HARDIRQ_SHIFT (7.3: "
                                 "HARDIRQ_DISABLE_SHIFT + HARDIRQ_DISABLE_BITS)",
        "can_probe_exception_insns": "arch/x86/kernel/kprobes/core.c: can_probe() "
                                     "(is_exception_insn(); absent in 6.1)",
        "fprobe_max_entry_data": "kernel/trace/trace_fprobe.c: trace_fprobe_create_internal() "
                                 "(ALIGN(entry_data_size) > MAX_FPROBE_DATA_SIZE, "
                                 "include/linux/fprobe.h); trace_probe.c: "
                                 "traceprobe_get_entry_data_size()",
        "arg_parser": "kernel/trace/trace_probe.c: parse_probe_arg() (a loop: "
                      "parse_probe_arg_nested(), parse_probe_arg_leaf(), unwind_parse_states())",
        "maxact_on_kprobe": "kernel/trace/trace_kprobe.c: trace_kprobe_create_internal()",
        "fetch_types": "kernel/trace/trace_probe.c: probe_fetch_types[]",
        "max_argstr_len": "kernel/trace/trace_probe.h: MAX_ARGSTR_LEN (255)",
        "too_many_args": "kernel/trace/trace_kprobe.c: trace_kprobe_create_internal() "
                         "(TOO_MANY_ARGS)",
        "symbol_check": "kernel/trace/trace_kprobe.c: validate_probe_symbol()",
        "symbols_vmlinux_first": "kernel/trace/trace_kprobe.c: number_of_same_symbols() "
                                 "(\"If the symbol is found in vmlinux, use vmlinux "
                                 "resolution only\")",
        "entry_args_on_return": "kernel/trace/trace_probe.c: parse_probe_var_arg(), "
                                "__store_entry_arg()",
        "btf_args": "kernel/trace/trace_probe.c: parse_btf_arg(), parse_btf_field(), "
                    "get_bitoffset_of_field()",
        "current_var": "kernel/trace/trace_probe.c: parse_probe_var_current(); "
                       "trace_probe_tmpl.h: FETCH_OP_CURRENT",
        "this_cpu": "kernel/trace/trace_probe.c: parse_this_cpu(); trace_probe_tmpl.h: "
                    "FETCH_OP_CPU_PTR",
        "typecasts": "kernel/trace/trace_probe.c: handle_typecast(), parse_btf_casttype()",
        "max_nested": "kernel/trace/trace_probe.h: TRACEPROBE_MAX_NESTED_LEVEL; "
                      "trace_probe.c: parse_probe_arg_nested()",
        "uprobe_no_symbol_types": "kernel/trace/trace_probe.c: find_fetch_type()",
        "dynevent_kinds": "kernel/trace/trace_fprobe.c: trace_fprobe_create_internal()",
        "uretprobe_syscall": "arch/x86/kernel/uprobes.c: uretprobe_trampoline_entry, "
                             "arch_uretprobe_trampoline(), SYSCALL_DEFINE0(uretprobe)",
    },
}

_REL = re.compile(r"^(\d+)\.(\d+)")


def series_of_release(release: str) -> str:
    """``6.12`` of ``6.12.117+deb13-cloud-amd64``; the text itself when it is no release."""
    m = _REL.match(release.strip())
    return f"{m[1]}.{m[2]}" if m else release.strip()


def _key(series: str) -> tuple[int, int]:
    a, b = series.split(".")
    return int(a), int(b)


@dataclass
class _Warned:
    seen: set[str] = field(default_factory=set)


_WARNED = _Warned()


def rules_for(series_or_release: str | None, config: Mapping[str, str] | None = None
              ) -> KernelRules:
    """The rules of a kernel series (``6.12``) or release (``6.12.117+deb13-cloud-amd64``).

    ``None`` is the default image's kernel, 6.1. A series the table lacks gets the newest
    known series before it (a warning is logged once); one older than 6.1 gets 6.1's.
    ``config`` (the kernel's ``CONFIG_*``) turns BTF arguments off for a kernel built
    without ``CONFIG_PROBE_EVENTS_BTF_ARGS``.
    """
    series = series_of_release(series_or_release) if series_or_release else "6.1"
    rules = SERIES.get(series)
    if rules is None:
        try:
            want = _key(series)
        except ValueError:
            want = (0, 0)
        older = [s for s in SERIES if _key(s) <= want]
        rules = SERIES[max(older, key=_key)] if older else SERIES["6.1"]
        if series not in _WARNED.seen:
            _WARNED.seen.add(series)
            log.warning("no probe-event rules for Linux %s: using %s's", series, rules.series)
    if config and rules.btf_args and config.get("CONFIG_PROBE_EVENTS_BTF_ARGS") != "y":
        from dataclasses import replace
        rules = replace(rules, btf_args=False)
    return rules
