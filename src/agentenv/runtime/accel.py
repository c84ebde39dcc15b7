"""Which accelerator a standard guest kernel can run under on this host: KVM or TCG.

This machine kind has a /dev/kvm that only runs PVM guests; a standard kernel hangs under it.
Detection: no /dev/kvm, or a PVM-only kvm (kvm_pvm loaded without kvm_intel/kvm_amd), means
TCG. Otherwise boot the kernel without a root filesystem under KVM: a working KVM reaches the
"VFS: Unable to mount root" panic (and QEMU exits through -no-reboot) within seconds; a hang
means TCG. The answer is cached per process.
"""

from __future__ import annotations

import os
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Literal

Accel = Literal["kvm", "tcg"]


def _module_loaded(name: str) -> bool:
    return Path("/sys/module", name).exists()


@lru_cache(maxsize=8)
def detect_accel(kernel: str | None = None, qemu: str = "qemu-system-x86_64") -> Accel:
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    if _module_loaded("kvm_pvm") and not (_module_loaded("kvm_intel") or _module_loaded("kvm_amd")):
        return "tcg"
    if kernel is None:
        return "kvm"
    try:
        proc = subprocess.run(
            [qemu, "-M", "q35,accel=kvm", "-cpu", "host", "-m", "128", "-nodefaults",
             "-display", "none", "-no-reboot", "-serial", "stdio", "-kernel", kernel,
             "-append", "console=ttyS0 panic=-1"],
            capture_output=True, timeout=15,
        )
    except subprocess.TimeoutExpired:
        return "tcg"
    return "kvm" if b"Kernel panic" in proc.stdout else "tcg"


def resolve_accel(setting: str, kernel: str | None = None) -> Accel:
    """`setting` is "auto", "kvm" or "tcg" (from config)."""
    if setting == "kvm":
        return "kvm"
    if setting == "tcg":
        return "tcg"
    if setting != "auto":
        from agentenv.runtime.errors import RuntimeError_

        raise RuntimeError_(f"accel must be auto, kvm or tcg, not {setting!r}")
    return detect_accel(kernel)
