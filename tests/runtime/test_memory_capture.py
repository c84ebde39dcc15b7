"""Capturing written pages of a private file mapping as a memory layer (no QEMU needed): a
child process stands in for QEMU, the result is checked byte for byte after materialising."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agentenv.runtime.memory import (
    MIN_ZERO_PAGES,
    PAGE,
    capture_memory_layer,
    find_ram_mapping,
    materialise,
)
from agentenv.storage.export import import_raw

SIZE = 8 << 20

# Maps the file privately, writes a pattern of data pages, short and long zero stretches over
# the file's 0xAA content, then waits for stdin to close.
CHILD = r"""
import mmap, os, sys
size, gap = int(sys.argv[2]), int(sys.argv[3])
fd = os.open(sys.argv[1], os.O_RDONLY)
m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
page = 4096
def put(n, data):
    m[n * page:(n + 1) * page] = data
for n in range(10, 200):                       # data, with a short zero gap at 50..52
    put(n, bytes(page) if 50 <= n < 53 else (b"%08d" % n) * (page // 8))
for n in range(300, 300 + gap + 5):           # a long zero stretch, then data
    put(n, bytes(page) if n < 300 + gap else b"z" * page)
put(2047, b"e" * page)                         # the last page
m[5 * page + 7] = 0x41                         # one byte in an otherwise untouched page
print("ready", flush=True)
sys.stdin.read()
"""


def test_capture_matches_process_memory(tmp_path: Path) -> None:
    lower_raw = tmp_path / "lower.raw"
    lower_raw.write_bytes(b"\xaa" * SIZE)
    lower = import_raw(lower_raw, tmp_path / "lower.layer")
    gap = MIN_ZERO_PAGES + 8
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(lower_raw), str(SIZE), str(gap)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        addr = find_ram_mapping(child.pid, str(lower_raw), SIZE)
        stats = capture_memory_layer(child.pid, addr, SIZE, tmp_path / "top.layer")
        # 190 + gap + 5 + 1 + 1 pages written; the long zero stretch (and only it) is stored
        # as a zeroed mapping, the short gap as data.
        assert stats.written_pages == 190 + gap + 5 + 2
        assert stats.zero_pages == gap
        out = materialise([lower, tmp_path / "top.layer"], tmp_path / "mem.raw", SIZE)
        with open(f"/proc/{child.pid}/mem", "rb") as mem:
            mem.seek(addr)
            expected = mem.read(SIZE)
        got = out.read_bytes()
        assert got[300 * PAGE:(300 + gap) * PAGE] == bytes(gap * PAGE)  # hides the 0xAA below
        assert got == expected
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
