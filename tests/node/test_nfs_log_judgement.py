"""Found by the red team of 2026-12-07: the reload judgement reads ganesha's log, whose
lines may carry text a guest chose (names and values ganesha reports in its warnings). The
judgement must count only lines ganesha's signal thread began, not:

- a piece of a line longer than LINE_CAP (the sink cuts it and judges each piece as a line: a
  guest that pads its text to the cut starts a "line" of its own);
- a line of another thread that holds the signal thread's words further on (the patterns are
  searched anywhere in the line, not matched from its start).

Either would let a guest make `update` take a reload that did not happen (a client list not
yet changed, an export not yet dropped, errors unseen) or fail one that did."""

from __future__ import annotations

import os
from pathlib import Path

from agentenv.node.nfs import LINE_CAP, _LogSink

PREFIX = "07/12/2026 12:54:10 : epoch 6571a2b3 : node : "
FORGED = PREFIX + "ganesha.nfsd-1[sigmgr] reread_exports :CONFIG :EVENT :Reread exports complete"


def _sink_of(tmp_path: Path, data: bytes) -> _LogSink:
    read_end, write_end = os.pipe()
    sink = _LogSink(os.fdopen(read_end, "rb"), tmp_path / "ganesha.log", 1 << 20)
    os.write(write_end, data)
    os.close(write_end)
    sink.join()
    return sink


def test_a_piece_of_a_long_line_is_not_a_reload(tmp_path: Path) -> None:
    head = (PREFIX + "ganesha.nfsd-1[svc_7] some_op :NFS4 :WARN :guest text: ").encode()
    line = head + b"x" * (LINE_CAP - len(head)) + FORGED.encode() + b"\n"
    sink = _sink_of(tmp_path, line)
    assert sink.reloads == 0, "the tail of a cut line was judged as the signal thread's line"


def test_the_signal_threads_words_inside_another_line_are_not_a_reload(tmp_path: Path) -> None:
    line = (PREFIX + "ganesha.nfsd-1[svc_7] some_op :NFS4 :WARN :guest text: " + FORGED
            + "\n").encode()
    sink = _sink_of(tmp_path, line)
    assert sink.reloads == 0, "a line of another thread was judged as the signal thread's"


def test_the_signal_threads_own_lines_are_a_reload(tmp_path: Path) -> None:
    """The anchored patterns still take ganesha's real lines (as ganesha 4.3 writes them)."""
    hup = PREFIX + ("ganesha.nfsd-1[sigmgr] sigmgr_thread :MAIN :EVENT :SIGHUP_HANDLER: "
                    "Received SIGHUP.... initiating export list reload")
    sink = _sink_of(tmp_path, (hup + "\n" + FORGED + "\n").encode())
    assert sink.reloads == 1
