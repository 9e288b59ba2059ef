"""kph fuzz's pure parts: strategies, classes of findings, regression files."""
from harness import fuzz


def test_listing_is_deterministic_and_mostly_well_formed():
    pool = ["vfs_read", "do_sys_openat2", "kernel_clone"]
    a = fuzz.list_examples(pool, examples=60, seed=11)
    assert a == fuzz.list_examples(pool, examples=60, seed=11)
    assert a != fuzz.list_examples(pool, examples=60, seed=12)
    from harness.errors import ProbeSpecError
    from harness.probespec import parse
    parsed = 0
    for ex in a:
        try:
            for ln in ex:
                parse(ln)
            parsed += 1
        except ProbeSpecError:
            pass
    assert parsed >= len(a) // 2, parsed


def test_signatures_blur_values_and_known_differences_are_listed():
    assert fuzz._shape("'0xffffff8134aa4a00' at 21") == "'S' at N"
    import re
    assert fuzz.KNOWN == ()   # below-sp reads, once known, are (unknown) host-side now


def test_regressions_round_trip(tmp_path):
    f = fuzz.Finding(("p vfs_read +u0($retval)",), "parse", "carets differ", "parse:x")
    p = fuzz.write_regression(f, tmp_path)
    assert fuzz.read_regressions(tmp_path) == [(p.name, ("p vfs_read +u0($retval)",))]


def test_each_kernel_s_grammar_is_drawn_from_its_own_rules():
    from harness import fuzz
    from harness.kernelrules import SERIES

    pool = ["vfs_read", "do_sys_openat2"]
    text = {k: " ".join(" ".join(ex) for ex in fuzz.list_examples(pool, examples=400, seed=5,
                                                                   rules=r))
            for k, r in SERIES.items()}
    assert "$current" in text["7.3"] and "this_cpu_" in text["7.3"]
    assert any(t in text["6.12"] for t in ("$arg*", "file->f_pos", "$arg1->f_flags"))
    # where a kernel lacks a construct it is drawn only as a defect, so far less often
    assert text["6.12"].count("$current") < text["7.3"].count("$current")
    assert text["6.1"].count("->") < text["6.12"].count("->")
