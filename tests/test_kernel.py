"""The compiled kernel (``streamsync._kernel``): built when the package is installed and
imported from the package like any module; nothing compiled, and no shared object loaded from
a cache or temp directory, at run time; the torch fallback where it was not built."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
import torch
from conftest import vllm_required

import streamsync as ss
from streamsync import _copies as copies

PACKAGE = Path(ss.__file__).parent

#: The first 16 hex digits of the sha256 of the kernel's source as the runtime build last
#: compiled it (streamsync/wire/_patch_kernel.c): the name it loaded is derived from them.
_LAST_RUNTIME_DIGEST = "dfaf0007b5b22f84"

# Runs every entry of the kernel (patches, the fused cast, the pool's copies and casts, many
# small moves, one large), then prints which kernel ran and every file mapped from `root`.
_EVERY_ENTRY = textwrap.dedent(
    """
    import sys

    import torch

    import streamsync as ss
    from streamsync import _copies as copies
    from streamsync.wire import patch

    root = sys.argv[1]
    base = torch.zeros(1 << 20)
    new = base.clone()
    new[::1000] = 1.0
    found = patch.diff(new.view(torch.uint8), base.view(torch.uint8), 4)
    assert found is not None and found[0].size == 1049
    patch.check(found[0], new.numel(), -1, "t")
    out = base.clone()
    patch.apply(out, found, 4)
    assert torch.equal(out, new)
    patch.diff_cast(new, base.to(torch.bfloat16).view(torch.uint8))
    big = torch.randn(3 * copies.PIECE_BYTES // 4)
    for dst in (torch.empty_like(big), torch.empty(big.shape, dtype=torch.bfloat16)):
        copies.copy_tensors([(dst, big)])
        assert torch.equal(dst, big.to(dst.dtype))
    small = [torch.full((7,), float(i)) for i in range(64)]
    got = [torch.empty(7) for _ in small]
    copies.copy_tensors(zip(got, small))
    assert all(torch.equal(a, b) for a, b in zip(got, small))
    print("kernel", patch.kernel())
    with open("/proc/self/maps") as fh:
        mapped = {line.split()[-1] for line in fh if len(line.split()) >= 6}
    for path in sorted(mapped):
        if path.startswith(root):
            print("mapped", path)
    """
)

# A shared object that, once loaded, says so in the file named by $PLANTED_MARKER.
_PLANTED_C = """
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *marker = getenv("PLANTED_MARKER");
    FILE *fh = marker ? fopen(marker, "a") : NULL;
    if (fh) { fputs("loaded\\n", fh); fclose(fh); }
}
"""

# A compiler that only says it was run.
_COMPILER = '#!/bin/sh\necho "$0 $*" >> "{marker}"\nexit 1\n'


def _runtime_names() -> list[str]:
    """The names the runtime build gave the kernel it compiled and loaded: for its source as
    last shipped, and for today's source."""
    digests = {_LAST_RUNTIME_DIGEST}
    source = PACKAGE / "_kernel.c"
    if source.exists():
        digests.add(hashlib.sha256(source.read_bytes()).hexdigest()[:16])
    return [f"patch-{d}-{platform.machine()}.so" for d in sorted(digests)]


def _run(script: str, root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    probe = root / "probe.py"
    probe.write_text(script)
    return subprocess.run(
        [sys.executable, str(probe), str(root)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env},
        timeout=300,
    )


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
@pytest.mark.slow  # a fresh interpreter: make test, not the edit loop
@pytest.mark.parametrize("planted", [True, False], ids=["planted-files", "a-compiler-to-run"])
def test_nothing_is_compiled_or_loaded_from_the_cache_or_temp_directories(
    tmp_path: Path, planted: bool
) -> None:
    # Home, the cache and the temp directory all point into tmp_path. With files planted at
    # every name the runtime build would load, none is loaded (its constructor never runs,
    # nothing from tmp_path is mapped); with nothing planted, the compiler on $CC and $PATH
    # is never run. Either way every kernel entry has been used.
    cc = shutil.which("cc")
    if planted and cc is None:
        pytest.skip("no C compiler here to build the shared object to plant")
    home, cache, tmp, bin_dir = (tmp_path / d for d in ("home", "cache", "tmp", "bin"))
    loaded, compiled = tmp_path / "loaded.txt", tmp_path / "compiled.txt"
    roots = [cache / "streamsync", home / ".cache" / "streamsync", tmp / "streamsync"]
    for d in (home, cache, tmp, bin_dir, *roots):
        d.mkdir(parents=True, exist_ok=True)
    if planted:
        source = tmp_path / "planted.c"
        source.write_text(_PLANTED_C)
        built = tmp_path / "planted.so"
        assert cc is not None
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(built), str(source)], check=True)
        for root in roots:
            for name in _runtime_names():
                shutil.copy(built, root / name)
    for name in ("cc", "gcc", "clang"):
        shim = bin_dir / name
        shim.write_text(_COMPILER.format(marker=compiled))
        shim.chmod(0o755)
    env = {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(cache),
        "TMPDIR": str(tmp),
        "CC": str(bin_dir / "cc"),
        "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),
        "PLANTED_MARKER": str(loaded),
    }
    out = _run(_EVERY_ENTRY, tmp_path, env)
    assert not loaded.exists(), f"a planted shared object was loaded: {out.stderr}"
    assert not compiled.exists(), f"a compiler ran: {compiled.read_text()}"
    assert out.returncode == 0, out.stderr
    assert "mapped" not in out.stdout, out.stdout
    assert f"kernel {copies.kernel()}" in out.stdout.splitlines()


def test_the_compiled_kernel_is_the_extension_inside_the_package() -> None:
    # Built by pip install (and setup.py build_ext --inplace): under make test and CI it
    # must be there; elsewhere (a checkout never built) the copies run the fallback.
    spec = importlib.util.find_spec("streamsync._kernel")
    if spec is None and not vllm_required():
        pytest.skip("the compiled kernel is not built here (pip install -e . builds it)")
    assert spec is not None and spec.origin is not None, "the compiled kernel was not built"
    assert Path(spec.origin).parent == PACKAGE
    assert copies.kernel() == "c"


async def test_each_sides_report_names_the_kernel_it_ran() -> None:
    weights = dict(torch.nn.Linear(8, 4).state_dict())
    sink = ss.ModuleSink(torch.nn.Linear(8, 4))
    reports: list[ss.SyncReport] = []

    async def rx() -> None:
        reports.append(await ss.receive("memory://kernel-report", sink, timeout=10))

    async with anyio.create_task_group() as tg:
        tg.start_soon(rx)
        reports.append(await ss.send(weights, "memory://kernel-report", timeout=10))
    assert sorted(r.side for r in reports) == ["receive", "send"]
    assert [r.kernel for r in reports] == [copies.kernel()] * 2


# Everything the kernel does, with the extension hidden: the fallback's bytes are torch's.
_FALLBACK = textwrap.dedent(
    """
    import sys

    sys.modules["streamsync._kernel"] = None  # as if it was not built: import fails

    import numpy as np
    import torch

    import streamsync as ss
    from streamsync import _copies as copies
    from streamsync.wire import patch

    assert copies.kernel() == "torch" and patch.kernel() == "torch"
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(3 * copies.PIECE_BYTES // 4 + 5, generator=gen)
    src[7] = float("nan")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dst = torch.empty(src.shape, dtype=dtype)
        copies.copy_tensors([(dst, src)])
        assert torch.equal(dst.view(torch.uint8), src.to(dtype).view(torch.uint8)), dtype
    half = src.to(torch.bfloat16)
    up = torch.empty(half.shape)
    copies.copy_tensors([(up, half)])
    assert torch.equal(up.view(torch.uint8), half.to(torch.float32).view(torch.uint8))
    small = [torch.full((9,), float(i)) for i in range(64)]
    got = [torch.empty(9) for _ in small]
    copies.copy_tensors(zip(got, small))
    assert all(torch.equal(a, b) for a, b in zip(got, small))
    buf = torch.arange(4096, dtype=torch.uint8)
    out = torch.zeros(4096, dtype=torch.uint8)
    plan = copies.MovePlan([0, 2048], [2048, 0], [2048, 2048])
    plan.run(out.data_ptr(), buf.data_ptr())
    assert torch.equal(out, torch.cat([buf[2048:], buf[:2048]]))

    base = torch.zeros(1 << 16)
    new = base.clone()
    new[::100] = 2.0
    found = patch.diff(new.view(torch.uint8), base.view(torch.uint8), 4)
    assert found is not None and found[0].tolist() == list(range(0, 1 << 16, 100))
    assert patch.check(found[0], new.numel(), -1, "t") == found[0][-1]
    patched = base.clone()
    patch.apply(patched, found, 4)
    assert torch.equal(patched, new)
    assert patch.diff_cast(new, base.to(torch.bfloat16).view(torch.uint8)) == patch.UNCAST
    report = ss.SyncReport(sync_id=0, side="send", tensors=0, nbytes=0, buckets=0, seconds=0.0)
    assert report.kernel == "torch"
    print("fallback ok")
    """
)


@pytest.mark.slow  # a fresh interpreter: make test, not the edit loop
def test_without_the_compiled_kernel_the_fallback_gives_the_same_bytes(tmp_path: Path) -> None:
    out = _run(_FALLBACK, tmp_path, {})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "fallback ok"
