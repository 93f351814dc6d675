"""The arm64 package (every Jetson is arm64) in a fresh arm64 Debian 12 tree, run by
qemu-user-static through binfmt_misc on this amd64 machine: `dpkg -i` with no network, edged
started as its user answering an inference over its socket, with the same answer as edged from
this checkout natively on amd64, and the times of each step printed (docs/BENCHMARKS.md, "arm64
under qemu").

`make packaging-arm64` builds what this needs (`make deb-arm64`, then
build/debian-base-arm64.tar with the package's Depends) and sets EDGED_ARM64=1: a missing part is
then a failure. Elsewhere (`make test`, CI) a missing part is a skip saying which, since building
them takes 6 to 12 minutes. Needs root (chroot, mounts), as tests/packaging/test_deb.py.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edged.client import Client
from tests.conftest import ROOT, Daemon
from tests.packaging.test_deb import VERSION, Tree, debian_tree

# Each arm64 target: what it is, its install tree, its package (make packaging-arm64 makes
# Debian 12's, make packaging-arm64-SUITE the others': Debian 13's with Python 3.13, Ubuntu
# 22.04's, JetPack 6's userland, with 3.10).
SUITES = {
    "bookworm": (
        "Debian 12",
        ROOT / "build" / "debian-base-arm64.tar",
        ROOT / "build" / "deb" / f"edged_{VERSION}_arm64.deb",
    ),
    **{
        suite: (
            where,
            ROOT / "build" / f"base-{suite}-arm64.tar",
            ROOT / "build" / "deb" / suite / f"edged_{VERSION}_arm64.deb",
        )
        for suite, where in (("trixie", "Debian 13"), ("jammy", "Ubuntu 22.04, JetPack 6's"))
    },
}
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
TEXTS = ["turn off the lights in the kitchen"]
RUNS = 10  # timed calls after the first, per architecture
EM_AARCH64 = 183  # e_machine of an arm64 ELF file
# The CPU qemu emulates, as the Makefile's QEMU_CPU: a Jetson Orin's ARMv8.2, without the pointer
# authentication that qemu's default emulates ten times slower (Debian 13's binaries use it).
QEMU = {"QEMU_CPU": os.environ.get("QEMU_CPU", "cortex-a76")}


def missing(reason: str, suite: str) -> None:
    """Skip, saying why; a failure where EDGED_ARM64 names the suite (make packaging-arm64:
    bookworm, make packaging-arm64-SUITE: that one; 1: bookworm)."""
    wanted = os.environ.get("EDGED_ARM64", "").replace("1", "bookworm").split(",")
    if suite in wanted:
        pytest.fail(f"{reason} (EDGED_ARM64 names {suite}: its make target makes every part)")
    pytest.skip(reason)


def make_target(suite: str) -> str:
    """What builds and tests ``suite``'s arm64 package."""
    return "packaging-arm64" if suite == "bookworm" else f"packaging-arm64-{suite}"


def qemu_problem() -> str | None:
    """Why arm64 programs cannot run in a chroot here, or None when they can."""
    if not (BINFMT.parent / "status").is_file():
        return f"binfmt_misc is not mounted on {BINFMT.parent}"
    if not BINFMT.is_file():
        return f"no binfmt_misc handler for arm64 ({BINFMT}): install qemu-user-static"
    lines = BINFMT.read_text().splitlines()
    if "enabled" not in lines:
        return f"{BINFMT} is disabled: update-binfmts --enable qemu-aarch64"
    flags = next((line.split(":", 1)[1] for line in lines if line.startswith("flags:")), "")
    # F: the kernel opens qemu when the handler is registered, so it works inside a chroot.
    if "F" not in flags:
        return f"{BINFMT} lacks the F flag: qemu cannot start inside a chroot"
    return None


@pytest.fixture(scope="module", params=sorted(SUITES))
def suite(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def tree(suite: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    where, base, deb = SUITES[suite]
    if os.geteuid() != 0:
        missing("installing into a tree needs root (chroot, dpkg)", suite)
    if os.uname().machine == "aarch64":
        missing(
            "this machine is arm64: tests/packaging/test_deb.py tests the package natively", suite
        )
    problem = qemu_problem()
    if problem:
        missing(problem, suite)
    if not deb.is_file():
        missing(
            f"{deb.relative_to(ROOT)} ({where}) is not built: `make {make_target(suite)}`"
            " builds it (6 to 15 minutes)",
            suite,
        )
    if not base.is_file():
        missing(
            f"{base.relative_to(ROOT)} ({where}) is missing: `make {make_target(suite)}`"
            " makes it with mmdebstrap",
            suite,
        )
    with debian_tree(base, tmp_path_factory.mktemp(f"{suite}-arm64"), QEMU) as found:
        yield found


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def inferences(client: Client) -> tuple[dict[str, Any], float, float]:
    """The first answer, its time, and the median time of RUNS more."""
    first, first_s = timed(lambda: client.task("intent", {"texts": TEXTS}))
    times = [timed(lambda: client.task("intent", {"texts": TEXTS}))[1] for _ in range(RUNS)]
    return first, first_s, statistics.median(times)


def logged(log: str, pattern: str) -> float:
    """A figure from edged's log (text or ECS JSON lines): the first group of the pattern."""
    found = re.search(pattern, log)
    assert found, f"no {pattern!r} in edged's log:\n{log[-3000:]}"
    return float(found.group(1))


LOAD_MS = r"model text-encoder: loaded \S+ with \S+ in (\d+) ms"  # its ONNX session
READY_S = r"ready in ([\d.]+) s: serving"  # edged's own: from its start to every model loaded


def elf_machine(path: Path) -> int:
    header = path.read_bytes()[:20]
    assert header[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return int.from_bytes(header[18:20], "little")


@pytest.mark.slow
@pytest.mark.timeout(3600)  # everything under emulation: minutes where amd64 takes seconds
def test_the_arm64_package_installs_and_answers_under_qemu(
    suite: str, tree: Tree, tmp_path: Path
) -> None:
    deb = SUITES[suite][2]
    # The package and the tree are arm64, and the tree's programs run under emulation.
    field = ["dpkg-deb", "-f", str(deb), "Architecture"]
    assert subprocess.run(field, capture_output=True, text=True, check=True).stdout == "arm64\n"
    assert tree.run("dpkg", "--print-architecture").strip() == "arm64"
    shutil.copy(deb, tree.path("/tmp/edged.deb"))
    _, install_s = timed(lambda: tree.run("dpkg", "-i", "/tmp/edged.deb", timeout=1800))
    python = "/usr/lib/edged/bin/python"
    machine = tree.run(python, "-c", "import platform; print(platform.machine())")
    assert machine.strip() == "aarch64"
    version, version_s = timed(lambda: tree.run("edged", "--version", timeout=600))
    assert version.strip() == f"edged {VERSION}"
    # ONNX Runtime's native library in the environment is arm64 code (PyPI's aarch64 wheel).
    capi = tree.path("/usr/lib/edged/lib").glob(
        "python3.*/site-packages/onnxruntime/capi/onnxruntime_pybind11_state*.so"
    )
    libraries = list(capi)
    assert len(libraries) == 1 and elf_machine(libraries[0]) == EM_AARCH64, libraries

    started = time.perf_counter()
    proc = tree.start_edged()
    try:
        client = tree.client(proc, ready_s=1200)
        ready_s = time.perf_counter() - started
        emulated, emulated_first_s, emulated_median_s = inferences(client)
    finally:
        tree.stop(proc)
    log = tree.path("/tmp/edged.log").read_text(errors="replace")
    emulated_load_ms, emulated_models_s = logged(log, LOAD_MS), logged(log, READY_S)
    print("answer under qemu:", emulated)

    # The same models from this checkout, natively, in the same run.
    (tmp_path / "native").mkdir()
    native = Daemon(tmp_path / "native")
    started = time.perf_counter()
    try:
        native.start()
        native_ready_s = time.perf_counter() - started
        answer, native_first_s, native_median_s = inferences(native.client)
    finally:
        assert native.stop() == 0, native.logs()
    native_load_ms, native_models_s = logged(native.logs(), LOAD_MS), logged(native.logs(), READY_S)
    print("answer natively:", answer)

    installed = int(tree.run("dpkg-query", "-W", "-f", "${Installed-Size}", "edged"))
    rows = [
        (".deb, installed", f"{deb.stat().st_size >> 20} MB, {installed >> 10} MB", "-"),
        ("dpkg -i (with byte-compiling)", f"{install_s:.1f} s", "-"),
        ("edged --version", f"{version_s:.1f} s", "-"),
        ("edged started to READY (the client)", f"{ready_s:.1f} s", f"{native_ready_s:.1f} s"),
        (
            "every model loaded (edged's log)",
            f"{emulated_models_s:.1f} s",
            f"{native_models_s:.1f} s",
        ),
        ("text-encoder's session load", f"{emulated_load_ms:.0f} ms", f"{native_load_ms:.0f} ms"),
        (
            "first intent call",
            f"{emulated_first_s * 1000:.0f} ms",
            f"{native_first_s * 1000:.0f} ms",
        ),
        (
            f"median of {RUNS} intent calls",
            f"{emulated_median_s * 1000:.0f} ms",
            f"{native_median_s * 1000:.0f} ms",
        ),
    ]
    print(f"\n{'step':34} {'arm64 under qemu':>18} {'amd64 native':>14}")
    for step, arm64, amd64 in rows:
        print(f"{step:34} {arm64:>18} {amd64:>14}")

    assert emulated["route"] == "local"
    mine, theirs = emulated["intents"][0], answer["intents"][0]
    assert mine["intent"] and mine["intent"] == theirs["intent"], (emulated, answer)
    # The same weights on two CPUs' kernels (NEON, AVX): the same score but for rounding.
    assert mine["score"] == pytest.approx(theirs["score"], abs=1e-3), (emulated, answer)
