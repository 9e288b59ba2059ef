"""Kernels built from source: the config check, the first error of a failed build, the
inputs refused before anything runs (harness.machine.image.kbuild)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.errors import SetupError
from harness.machine.image import kbuild, ksource


def test_the_fragment_asks_for_what_the_harness_needs():
    want = kbuild.required_options()
    for opt in ("CONFIG_64BIT", "CONFIG_KPROBES", "CONFIG_KPROBE_EVENTS", "CONFIG_UPROBE_EVENTS",
                "CONFIG_DEBUG_INFO_BTF", "CONFIG_VIRTIO_CONSOLE", "CONFIG_VIRTIO_PCI",
                "CONFIG_MODULES", "CONFIG_INET", "CONFIG_FTRACE_SYSCALLS", "CONFIG_KALLSYMS_ALL",
                "CONFIG_BLK_DEV_INITRD", "CONFIG_DEVTMPFS", "CONFIG_DYNAMIC_FTRACE",
                "CONFIG_FPROBE", "CONFIG_UNWINDER_ORC", "CONFIG_BINFMT_SCRIPT"):
        assert want.get(opt) == "y", opt
    assert want["CONFIG_PVPANIC_PCI"] == "m"      # a module, as the selftests probe one


def test_an_option_olddefconfig_dropped_is_named():
    config = "CONFIG_KPROBES=y\n# CONFIG_DEBUG_INFO_BTF is not set\nCONFIG_HZ=250\n"
    want = {"CONFIG_KPROBES": "y", "CONFIG_DEBUG_INFO_BTF": "y", "CONFIG_HZ": "250",
            "CONFIG_FPROBE": "y"}
    assert kbuild.missing_options(config, want) == ["CONFIG_DEBUG_INFO_BTF", "CONFIG_FPROBE"]


def test_the_first_compiler_error_is_the_one_reported():
    log = ("  CC      kernel/kprobes.o\n"
           "kernel/kprobes.c: In function 'foo':\n"
           "kernel/kprobes.c:12:5: error: 'x' undeclared (first use in this function)\n"
           "kernel/kprobes.c:13:5: error: expected ';' before '}' token\n"
           "make[4]: *** [scripts/Makefile.build:229: kernel/kprobes.o] Error 1\n")
    assert kbuild.first_error(log) == \
        "kernel/kprobes.c:12:5: error: 'x' undeclared (first use in this function)"
    assert kbuild.first_error("ld: vmlinux.o: undefined reference to `foo'\n").endswith("`foo'")
    assert kbuild.first_error("make: *** No rule to make target 'bzImage'.  Stop.\n") \
        .startswith("make: ***")


def test_a_series_is_not_a_path():
    assert ksource.is_series("6.12") and ksource.is_series("7.3")
    assert not ksource.is_series("./6.12") and not ksource.is_series("6") \
        and not ksource.is_series("linux-6.12")


def test_the_tree_version_comes_from_its_makefile(tmp_path):
    (tmp_path / "Makefile").write_text("# SPDX\nVERSION = 6\nPATCHLEVEL = 12\nSUBLEVEL = 117\n"
                                       "EXTRAVERSION =\nNAME = Baby Opossum Posse\n")
    assert kbuild.tree_version(tmp_path) == "6.12.117"


def test_what_is_not_a_tree_is_refused_with_the_way_to_get_one(tmp_path):
    with pytest.raises(SetupError, match="is not a kernel source tree") as e:
        kbuild.check_tree(tmp_path)
    assert "kph kernel fetch" in e.value.hint
    with pytest.raises(SetupError, match="no kernel source tree at"):
        kbuild.check_tree(tmp_path / "nope")


@pytest.mark.parametrize("argv, words", [
    (["kernel", "build", "/nonexistent/linux"], "no kernel source tree at /nonexistent/linux"),
    (["kernel", "fetch", "six"], "not a kernel series: 'six'"),
    (["kernel", "build", ".", "-j", "0"], "-j 0"),
    (["kernel"], "kph kernel needs an action"),
    (["image", "build", "--patch", "x.patch"], "--patch is for an image of a kernel tree"),
    (["image", "build", "--tree", "6.12", "--kernel", "6.1"], "--kernel and --tree name two kernels"),
    (["image", "build", "--tree", "/nonexistent/linux"], "no kernel source tree at /nonexistent/linux"),
    (["image", "build", "--tree", "6.12", "--patch", "/nonexistent.patch"],
     "--patch /nonexistent.patch: no such file"),
    (["boot", "--image", "tree:/nonexistent/linux", "--run", "true"],
     "no kernel source tree at /nonexistent/linux"),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, tmp_path):
    r = subprocess.run([sys.executable, "-m", "harness.cli", *argv], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def _fake_tree(root, source: str):
    """A tree kbuild takes for a kernel: its make targets configure with the fragment as
    it is and "build" by compiling ``source`` with the real gcc."""
    (root / "arch/x86").mkdir(parents=True)
    (root / "Kconfig").write_text("")
    (root / "scripts/kconfig").mkdir(parents=True)
    merge = root / "scripts/kconfig/merge_config.sh"
    merge.write_text('#!/bin/sh\n# merge_config.sh -m -O OUT BASE FRAGMENT\n'
                     'cat "$5" >> "$4"\n')
    merge.chmod(0o755)
    (root / "bad.c").write_text(source)
    (root / "Makefile").write_text(
        "VERSION = 6\nPATCHLEVEL = 99\nSUBLEVEL = 1\n"
        "tinyconfig:\n\t@echo '# tiny' > $(O)/.config\n"
        "olddefconfig:\n\t@true\n"
        "bzImage:\n\tgcc -c $(CURDIR)/bad.c -o $(O)/bad.o\n"
        "\tmkdir -p $(O)/arch/x86/boot && cp $(O)/bad.o $(O)/arch/x86/boot/bzImage\n"
        "\tcp $(O)/bad.o $(O)/vmlinux\n"
        "modules:\n\t@true\n")
    return root


def test_a_failed_build_reports_its_first_compiler_error(tmp_path):
    tree = _fake_tree(tmp_path / "tree", "int f(void) { return undeclared_thing; }\n")
    with pytest.raises(SetupError, match=r"the kernel build failed: .*bad.c:1:\d+: error: "
                                         r"'undeclared_thing' undeclared") as e:
        kbuild.build(tree, tmp_path / "out", jobs=1)
    assert "kph-build.log" in e.value.hint and (tmp_path / "out/kph-build.log").is_file()


def test_a_tree_that_builds_gives_its_images_and_is_not_configured_twice(tmp_path):
    tree = _fake_tree(tmp_path / "tree", "int f(void) { return 0; }\n")
    lines = []
    kb = kbuild.build(tree, tmp_path / "out", jobs=1, progress=lines.append)
    assert kb.version == "6.99.1" and kb.bzimage.is_file() and kb.vmlinux.is_file()
    assert any("configuring" in ln for ln in lines)
    lines.clear()
    assert kbuild.build(tree, tmp_path / "out", jobs=1, progress=lines.append).config_sha256 \
        == kb.config_sha256
    assert not any("configuring" in ln for ln in lines), lines


def test_an_option_the_tree_cannot_take_is_named(tmp_path):
    tree = _fake_tree(tmp_path / "tree", "int f(void) { return 0; }\n")
    frag = tmp_path / "frag.config"
    frag.write_text("CONFIG_KPROBES=y\nCONFIG_KPH_NOT_IN_THIS_TREE=y\n")
    (tree / "Makefile").write_text((tree / "Makefile").read_text().replace(
        "olddefconfig:\n\t@true\n",
        "olddefconfig:\n\tgrep -v NOT_IN_THIS_TREE $(O)/.config > $(O)/c; mv $(O)/c $(O)/.config\n"))
    with pytest.raises(SetupError, match="cannot be configured with CONFIG_KPH_NOT_IN_THIS_TREE"):
        kbuild.build(tree, tmp_path / "out", jobs=1, fragment=frag)


def test_what_booting_needs_is_in_the_fragment():
    want = kbuild.required_options()
    assert all(want.get(k) == "y" for k in kbuild.BOOT_NEEDS), \
        [k for k in kbuild.BOOT_NEEDS if want.get(k) != "y"]


def test_a_build_without_the_guest_agent_s_port_is_refused_before_it_boots(tmp_path):
    """A tree configured elsewhere (virtio-console a module, or off) would boot and then
    wait for an agent that cannot start: refused first, each option named with why."""
    d = tmp_path / "mybuild"
    (d / "arch/x86/boot").mkdir(parents=True)
    (d / "arch/x86/boot/bzImage").write_bytes(b"\0" * 0x202 + b"HdrS")
    config = "\n".join(f"{k}=y" for k in kbuild.BOOT_NEEDS if k != "CONFIG_VIRTIO_CONSOLE")
    (d / ".config").write_text(config + "\nCONFIG_VIRTIO_CONSOLE=m\n")
    assert kbuild.boot_refusal((d / ".config").read_text()) == \
        "CONFIG_VIRTIO_CONSOLE is not built in (the guest agent talks over virtio-serial)"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "boot", "--kernel", str(d),
                        "--dry-run"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cannot boot the harness's initramfs: CONFIG_VIRTIO_CONSOLE is not built in" \
        in r.stderr and "kph kernel build" in r.stderr
    (d / ".config").write_text(config + "\nCONFIG_VIRTIO_CONSOLE=y\n")
    assert kbuild.boot_refusal((d / ".config").read_text()) is None


def test_a_build_that_hangs_silently_is_stopped_at_its_deadline(tmp_path):
    tree = _fake_tree(tmp_path / "tree", "int f(void) { return 0; }\n")
    (tree / "Makefile").write_text((tree / "Makefile").read_text().replace(
        "bzImage:\n", "bzImage:\n\tsleep 600\n"))
    t0 = __import__("time").monotonic()
    with pytest.raises(SetupError, match="took over 2 s and was stopped"):
        kbuild.build(tree, tmp_path / "out", jobs=1, timeout=2.0)
    assert __import__("time").monotonic() - t0 < 30
    r = subprocess.run(["pgrep", "-f", "sleep 600"], capture_output=True, text=True)
    assert r.stdout.strip() == "", "the build's processes outlived it"


# ---------------------------------------------------------------- images of trees, --patch

def _src_tree(root):
    """A small tree with one source file a patch can change."""
    (root / "kernel/trace").mkdir(parents=True)
    (root / "kernel/trace/trace_probe.c").write_text(
        "".join(f"line {i}\n" for i in range(1, 41)))
    return root


def _patch(path, old: str, new: str, start: int = 20):
    ctx = [f"line {i}" for i in range(start - 3, start)]
    after = [f"line {i}" for i in range(start + 1, start + 4)]
    body = [f" {c}" for c in ctx] + [f"-{old}", f"+{new}"] + [f" {c}" for c in after]
    path.write_text("Subject: [PATCH] a change\n---\n"
                    "--- a/kernel/trace/trace_probe.c\n+++ b/kernel/trace/trace_probe.c\n"
                    f"@@ -{start - 3},7 +{start - 3},7 @@ static int f(void)\n"
                    + "\n".join(body) + "\n")
    return path


def test_a_patch_is_applied_to_a_copy_and_the_tree_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("KPH_CACHE", str(tmp_path / "cache"))
    src = _src_tree(tmp_path / "linux")
    p = _patch(tmp_path / "fix.patch", "line 20", "line twenty")
    lines = []
    copy = ksource.apply_patches(src, [p], lines.append)
    assert copy.parent == tmp_path / "cache/src" and copy.name.startswith("linux+")
    assert "line twenty\n" in (copy / "kernel/trace/trace_probe.c").read_text()
    assert "line twenty" not in (src / "kernel/trace/trace_probe.c").read_text()
    assert (copy / ".kph-patches").read_text().split()[1] == str(p)
    # made once: the second call finds it
    lines.clear()
    assert ksource.apply_patches(src, [p], lines.append) == copy
    assert any("patched already" in ln for ln in lines)


def test_a_patch_that_does_not_apply_names_its_first_rejected_hunk(tmp_path, monkeypatch):
    monkeypatch.setenv("KPH_CACHE", str(tmp_path / "cache"))
    src = _src_tree(tmp_path / "linux")
    p = _patch(tmp_path / "stale.patch", "line 20 as it was", "line twenty")
    with pytest.raises(SetupError, match=r"stale.patch does not apply to linux: "
                       r"kernel/trace/trace_probe.c hunk #1 @@ -17,7 \+17,7 @@ static int "
                       r"f\(void\) \(the tree differs at line 17\)") as e:
        ksource.apply_patches(src, [p])
    assert "rebase" in e.value.hint
    # nothing half-written is left in the cache
    assert [d.name for d in (tmp_path / "cache/src").iterdir() if not d.name.endswith(".lock")] == []


def test_what_is_not_a_patch_is_refused(tmp_path):
    with pytest.raises(SetupError, match="--patch .*nope.patch: no such file"):
        ksource.check_patches([tmp_path / "nope.patch"])
    (tmp_path / "notes.txt").write_text("just words\n")
    with pytest.raises(SetupError, match="not a unified diff"):
        ksource.check_patches([tmp_path / "notes.txt"])


def test_a_build_directory_is_used_as_it_is_or_refused_with_the_reason(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "Makefile").write_text("include ../linux/Makefile\n")
    good = "".join(f"{k}=y\n" for k in {**kbuild.BOOT_NEEDS, **kbuild.IMAGE_NEEDS})
    (out / ".config").write_text(good.replace("CONFIG_KPROBE_EVENTS=y\n", ""))
    with pytest.raises(SetupError, match=r"cannot make an image: CONFIG_KPROBE_EVENTS is not "
                       r"set \(y\) \(the guest's kprobe_events\)"):
        kbuild.use_built(out)
    (out / ".config").write_text(good)
    with pytest.raises(SetupError, match=r"is configured but not built \(no arch/x86/boot/bzImage,"
                       ) as e:
        kbuild.use_built(out)
    assert e.value.hint.startswith(f"build it: make -C {out}")


def test_a_tree_selector_names_a_tree_and_its_patches():
    from harness.machine.image.build import parse_tree_selector

    assert parse_tree_selector("6.12") is None
    assert parse_tree_selector("tree:6.12") == ("6.12", [])
    assert parse_tree_selector("tree:/src/linux+a.patch+b.patch") == \
        ("/src/linux", ["a.patch", "b.patch"])
    with pytest.raises(SetupError, match="names no tree"):
        parse_tree_selector("tree:")


def _new_file_patch(path, rel: str, text: str):
    path.write_text(f"--- /dev/null\n+++ b/{rel}\n@@ -0,0 +1 @@\n+{text}\n")
    return path


def test_variants_of_a_tree_share_one_copy_and_put_back_what_the_last_one_changed(
        tmp_path, monkeypatch):
    """Every patched variant of a tree is built in one copy and one build directory: the
    next variant puts the previous one's files back as the tree has them, with a new
    mtime (make rebuilds them), then applies its own; the tree itself is never written."""
    import os

    monkeypatch.setenv("KPH_CACHE", str(tmp_path / "cache"))
    built = []
    monkeypatch.setattr(kbuild, "build", lambda src, out, **kw: built.append((src, out)) or
                        kbuild.KernelBuild(src, out, "6.99.1", "sha"))
    src = _src_tree(tmp_path / "linux")
    f = "kernel/trace/trace_probe.c"
    a = _patch(tmp_path / "a.patch", "line 20", "line twenty")
    b = _patch(tmp_path / "b.patch", "line 30", "line thirty", start=30)
    new = _new_file_patch(tmp_path / "new.patch", "kernel/trace/extra.c", "int x;")
    said = []
    with kbuild.variant(src, [a, new], said.append) as kb:
        tree = kb.src
        assert tree == kbuild.variant_dir(src) and tree.name == "linux+variants"
        assert "line twenty\n" in (tree / f).read_text() and (tree / "kernel/trace/extra.c").exists()
    os.utime(tree / f, (1, 1))                  # as if built long ago
    with kbuild.variant(src, [b], said.append) as kb2:
        text = (tree / f).read_text()
        assert "line twenty" not in text and "line 20\n" in text and "line thirty\n" in text
        assert not (tree / "kernel/trace/extra.c").exists()     # created by a: gone with it
        assert (tree / f).stat().st_mtime > 1                   # make sees it changed
        assert kb2.out == built[0][1]           # one build directory for every variant
    assert any("putting back 2 file(s)" in s for s in said)
    # the same variant again touches nothing
    os.utime(tree / f, (1, 1))
    with kbuild.variant(src, [b], said.append):
        assert (tree / f).stat().st_mtime == 1
    assert "line twenty" not in (src / f).read_text() and "line 30\n" in (src / f).read_text()
    assert not (src / "kernel/trace/extra.c").exists()


def test_a_variant_that_does_not_apply_leaves_the_tree_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("KPH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kbuild, "build", lambda src, out, **kw: kbuild.KernelBuild(
        src, out, "6.99.1", "sha"))
    src = _src_tree(tmp_path / "linux")
    good = _patch(tmp_path / "good.patch", "line 20", "line twenty")
    stale = _patch(tmp_path / "stale.patch", "line 30 as it was", "x", start=30)
    with pytest.raises(SetupError, match="stale.patch does not apply"):
        with kbuild.variant(src, [good, stale]):
            pass
    tree = kbuild.variant_dir(src)
    assert (tree / "kernel/trace/trace_probe.c").read_text() == \
        (src / "kernel/trace/trace_probe.c").read_text()
    with kbuild.variant(src, [good]) as kb:
        assert "line twenty\n" in (kb.src / "kernel/trace/trace_probe.c").read_text()


def test_a_tree_is_built_in_its_own_subdirectory_and_copies_leave_the_build_out(
        tmp_path, monkeypatch):
    """``SRC/.kph-build`` makes kbuild name the tree ``..``, so the same file of two trees
    compiles with one command and ccache shares it; a copy of a built tree (a patched
    copy, the variant tree) must not carry hard links to the build's files."""
    monkeypatch.setenv("KPH_CACHE", str(tmp_path / "cache"))
    src = _src_tree(tmp_path / "linux")
    assert kbuild.default_out(src) == src / ".kph-build"
    (src / ".kph-build").mkdir()
    (src / ".kph-build/vmlinux").write_text("built")
    dest = tmp_path / "copy"
    ksource.link_copy(src, dest)
    assert (dest / "kernel/trace/trace_probe.c").samefile(src / "kernel/trace/trace_probe.c")
    assert not (dest / ".kph-build").exists()
    monkeypatch.delenv("CCACHE_DIR", raising=False)
    monkeypatch.setattr(kbuild.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.delenv("CCACHE_NODEPEND", raising=False)
    assert kbuild.ccache_env() == {"CCACHE_DIR": str(tmp_path / "cache/ccache"),
                                   "CCACHE_NOHASHDIR": "1", "CCACHE_DEPEND": "1"}
    monkeypatch.setenv("CCACHE_DIR", str(tmp_path / "mine"))      # the user's own cache
    assert kbuild.ccache_env()["CCACHE_DIR"] == str(tmp_path / "mine")
    monkeypatch.setenv("CCACHE_NODEPEND", "1")                    # the user's own mode
    assert "CCACHE_DEPEND" not in kbuild.ccache_env()
    monkeypatch.setattr(kbuild.shutil, "which", lambda name: None)
    assert kbuild.ccache_env() == {}


def test_debian_s_sources_are_not_kph_s_patched_copies_or_variant_trees(tmp_path, monkeypatch):
    monkeypatch.setenv("KPH_CACHE", str(tmp_path / "cache"))
    d = ksource.sources_dir()
    for name, stamp in (("linux-source-6.12.117-1", None),
                        ("linux-source-6.12.117-1+0123456789ab", ".kph-patches"),
                        ("linux-source-6.12.117-1+variants", ksource.VARIANT_STAMP),
                        ("linux-source-7.3.4-1~bpo13+1", None)):
        (d / name).mkdir(parents=True)
        (d / name / "Makefile").write_text("")
        if stamp:
            (d / name / stamp).write_text("")
    assert [p.name for p in ksource.unpacked_sources("6.12")] == ["linux-source-6.12.117-1"]
    assert [p.name for p in ksource.unpacked_sources("7.3")] == ["linux-source-7.3.4-1~bpo13+1"]


def test_a_debug_build_merges_the_debug_options_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """--debug: kernel.config then kernel-debug.config as one fragment (every `=y` of
    both checked after olddefconfig), built in TREE/.kph-build-debug beside the plain
    build's TREE/.kph-build; the debug fragment does not key the Debian images."""
    from harness.machine.image import store

    monkeypatch.setenv("KPH_CACHE", str(tmp_path / "cache"))
    assert kbuild.fragment_for(False) == kbuild.FRAGMENT
    f = kbuild.fragment_for(True)
    want = kbuild.required_options(f)
    assert {k: want[k] for k in ("CONFIG_PROVE_LOCKING", "CONFIG_PROVE_RCU",
                                 "CONFIG_DEBUG_ATOMIC_SLEEP", "CONFIG_KASAN")} == \
        dict.fromkeys(("CONFIG_PROVE_LOCKING", "CONFIG_PROVE_RCU",
                       "CONFIG_DEBUG_ATOMIC_SLEEP", "CONFIG_KASAN"), "y")
    assert set(kbuild.required_options()) <= set(want)      # the plain fragment's too
    assert kbuild.fragment_for(True) == f and f.read_text().startswith(kbuild.FRAGMENT.read_text())
    src = tmp_path / "linux"
    src.mkdir()
    assert kbuild.default_out(src) == src / ".kph-build"
    assert kbuild.default_out(src, True) == src / ".kph-build-debug"
    assert "kernel-debug.config" in store.FRAGMENTS
