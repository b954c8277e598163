"""Run a command as on an AVX2 CPU without AVX-512 or VNNI, on this machine.

    .venv/bin/python tests/support/avx2_cpu.py .venv/bin/python tests/bench/bench_int8_kernels.py

Serving's int8 kernels differ by CPU (README, Models, "int8 on CPUs without VNNI"): where the
fast ones saturate, serving runs the exact ones, ~1.2x slower. Timing or testing that branch
used to need such a machine. This compiles ``avx2_only.c`` with the system C compiler
(cached under ``.cache/avx2_cpu/``, keyed by the source's hash) and preloads it, so the
command's CPUID reports AVX2 only and onnxruntime and numpy dispatch as there. It needs x86-64
Linux with CPUID faulting (``grep cpuid_fault /proc/cpuinfo``) and ``cc``;
``unavailable()`` says why not, for a test to skip with. The kernel bench read the same
under it on an AVX-512 VNNI EPYC as on an AVX2 EPYC (README), so its figures stand for such
CPUs. Python's faulthandler must stay off in the command (pytest enables it: pass
``-p no:faulthandler``): it would take the shim's traps.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("avx2_only.c")
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "avx2_cpu"


def unavailable() -> str | None:
    """Why the shim cannot run here, or None."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64 Linux, not {sys.platform} {platform.machine()}"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "no /proc/cpuinfo"
    if " cpuid_fault" not in flags:
        return "this CPU or hypervisor has no CPUID faulting (cpuid_fault in /proc/cpuinfo)"
    if shutil.which("cc") is None:
        return "no C compiler (cc)"
    return None


def shim() -> Path:
    """The compiled shim, built once per source version."""
    reason = unavailable()
    if reason:
        raise RuntimeError(f"cannot run as an AVX2 CPU here: {reason}")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    out = CACHE / f"avx2_only-{digest}.so"
    if not out.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE)], check=True)
        tmp.replace(out)
    return out


def environ(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's) with the shim preloaded and faulthandler off."""
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = " ".join(p for p in (str(shim()), env.get("LD_PRELOAD", "")) if p)
    env.pop("PYTHONFAULTHANDLER", None)
    return env


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    os.execvpe(sys.argv[1], sys.argv[1:], environ())
