"""The Java kernel's runner made ready ahead of its first start: JShellRunner.java compiled
into a jar and a CDS archive (the classes a start loads: the runner's, javac's and JShell's,
as one training run loaded them) kept under CACHE_DIR. The code-interpreter server does this
at its start in the template (python3 -m agentenv.guest.codeint.javaprep), so every sandbox's
JVM starts from them; without them (no cache, or a failed preparation) the kernel runs the
source file through Java's single-file launcher, which compiles it at each start.

No ipykernel here: the server runs this as a subprocess, the kernel imports the paths."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

RUNNER = Path(__file__).resolve().parent / "JShellRunner.java"
CACHE_DIR = Path("/var/cache/aenv-codeint/java")
# (the JIT's C1 only, which starts faster; a serial GC, small as a kernel's heap is): the same
# for the training run and every start, as the archive needs
JAVA_OPTIONS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xss4m",
                "-Dfile.encoding=UTF-8")
TRAINING_SECONDS = 600.0
# a cell that loads what a user's first ones need: a statement, output, an expression's value
TRAINING_CELL = 'System.out.println("ready"); String.valueOf(1 + 1)'


def java_binary() -> str | None:
    java = shutil.which("java")
    return os.path.realpath(java) if java else None


def cache_entry() -> Path | None:
    """Where this runner's jar and archive go for this JVM (None without a JVM)."""
    java = java_binary()
    if java is None:
        return None
    digest = hashlib.sha256(RUNNER.read_bytes())
    digest.update(f"{java}:{os.stat(java).st_mtime_ns}:{' '.join(JAVA_OPTIONS)}".encode())
    return CACHE_DIR / digest.hexdigest()[:16]


def prepared() -> tuple[Path, Path] | None:
    """The jar and the archive, if this runner has them."""
    entry = cache_entry()
    if entry is None:
        return None
    jar, archive = entry / "runner.jar", entry / "runner.jsa"
    return (jar, archive) if jar.is_file() and archive.is_file() else None


def java_argv() -> list[str]:
    """How the kernel starts its runner: from the prepared jar and archive, else the source."""
    ready = prepared()
    if ready is None:
        return ["java", *JAVA_OPTIONS, str(RUNNER)]
    jar, archive = ready
    return ["java", *JAVA_OPTIONS, f"-XX:SharedArchiveFile={archive}", "-Xshare:auto",
            "-cp", str(jar), "JShellRunner"]


def _train(jar: Path, archive: Path) -> None:
    """One start of the runner from the jar, one cell, then its exit writes the archive."""
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    env = {**os.environ, "AENV_JAVA_REQUEST_FD": str(requests_r),
           "AENV_JAVA_REPLY_FD": str(replies_w)}
    env.pop("PYTHONPATH", None)
    child = subprocess.Popen(
        ["java", *JAVA_OPTIONS, f"-XX:ArchiveClassesAtExit={archive}", "-cp", str(jar),
         "JShellRunner"],
        env=env, pass_fds=(requests_r, replies_w), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(requests_r)
    os.close(replies_w)
    try:
        with os.fdopen(replies_r, "rb") as replies:
            if replies.readline() != b"READY\n":
                raise RuntimeError("the runner did not start")
            os.write(requests_w, b"X " + base64.b64encode(TRAINING_CELL.encode()) + b"\n")
            while not replies.readline().startswith((b"D", b"F")):
                pass
    finally:
        os.close(requests_w)  # the runner exits at the end of its requests
        child.wait(TRAINING_SECONDS)


def prepare() -> Path | None:
    """Makes this runner's jar and archive unless they are there; their directory."""
    entry = cache_entry()
    if entry is None or prepared() is not None:
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=entry.parent) as tmp:
        work = Path(tmp)
        classes = work / "classes"
        subprocess.run(["javac", "-nowarn", "-XDsuppressNotes", "-d", str(classes),
                        str(RUNNER)], check=True, capture_output=True,
                       timeout=TRAINING_SECONDS)
        made = work / "entry"
        made.mkdir()
        with zipfile.ZipFile(made / "runner.jar", "w") as jar:
            for path in sorted(classes.rglob("*.class")):
                jar.write(path, path.relative_to(classes).as_posix())
        # the archive names the jar by its path: trained from where it will be used
        os.rename(made, entry)
        try:
            _train(entry / "runner.jar", entry / "runner.jsa.tmp")
            os.rename(entry / "runner.jsa.tmp", entry / "runner.jsa")
        except BaseException:
            shutil.rmtree(entry, ignore_errors=True)
            raise
    return entry


if __name__ == "__main__":
    where = prepare()
    print(f"java runner prepared in {where}" if where else "no java: nothing to prepare",
          file=sys.stderr)
