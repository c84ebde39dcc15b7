"""The E2B Code Interpreter SDK, unchanged, against a VM node's built-in `code-interpreter-v1`
template (issue 29): stateful Python, JavaScript, Bash, TypeScript, R and Java kernels,
streamed output, rich results and chart data, errors, interrupts, contexts, per-call env vars, pause and connect, fork,
snapshots, concurrent async clients, the sandbox's egress policy on the kernels' traffic; and
the JS SDK (npm `@e2b/code-interpreter`, pinned in ts-code-interpreter/package-lock.json, run by
node) for the basic cases.

Run under flock /tmp/aenv-vmtest.lock (it starts QEMU). The node's first start builds the
template (debootstrap of the Jupyter packages is cached in conftest.DEBIAN_CACHE)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from e2b import TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox
from e2b_code_interpreter.charts import BarChart, ChartType, LineChart

from tests.netlab import Internet, internet
from tests.node import conftest, npm_pinned
from tests.node.conftest import NodeProcess

pytestmark = pytest.mark.qemu  # boots VMs

NET_PREFIX = "aci"  # unique: a test teardown deletes every {NET_PREFIX}-s* namespace
FIRST_SLOT = 22001  # 22001-22400
LAB_PREFIX, LAB_SUBNET = "acil", 43  # the egress test's "internet" (tests/netlab.py)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
JS_DIR = Path(__file__).parent / "ts-code-interpreter"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
T = TypeVar("T")


@pytest.fixture(scope="module")
def ci_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("codeint")
    node = conftest.vm_node_process(
        base / "state", base / "node.log", NET_PREFIX, FIRST_SLOT,
        {**conftest.NO_READY_POOLS, "AENV_VM_CODE_INTERPRETER": "1"})
    node.start_timeout = 1200  # a cold debootstrap of the Jupyter stack, then the template boot
    with conftest.serving_vm_node(node, NET_PREFIX):
        yield node


@pytest.fixture(scope="module")
def sbx(ci_node: NodeProcess) -> Iterator[Sandbox]:
    t0 = time.monotonic()
    sandbox = Sandbox.create(timeout=600)
    first = sandbox.run_code("1 + 1")
    print(f"\ncreate to first result: {time.monotonic() - t0:.2f} s")
    assert first.text == "2"
    yield sandbox
    sandbox.kill()


def test_state_is_kept_between_calls(sbx: Sandbox) -> None:
    first = sbx.run_code("x = 1")
    assert first.error is None and first.results == []
    second = sbx.run_code("x + 1")
    assert second.text == "2"
    assert second.execution_count == first.execution_count + 1


def test_stdout_and_stderr_stream_in_order(sbx: Sandbox) -> None:
    seen: list[tuple[str, str]] = []
    execution = sbx.run_code(
        "import sys\nprint('one')\nprint('two', file=sys.stderr)\nsys.stderr.flush()\n"
        "print('three')",
        on_stdout=lambda m: seen.append(("out", m.line)),
        on_stderr=lambda m: seen.append(("err", m.line)))
    assert "".join(execution.logs.stdout) == "one\nthree\n"
    assert "".join(execution.logs.stderr) == "two\n"
    assert [line for kind, line in seen if kind == "out"] == execution.logs.stdout
    assert [line for kind, line in seen if kind == "err"] == execution.logs.stderr


def test_rich_results(sbx: Sandbox) -> None:
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9], label='squares')\n"
        "plt.title('Squares')\nplt.xlabel('Time (s)')\nplt.show()")
    assert execution.error is None, execution.error
    [figure] = execution.results
    assert base64.b64decode(figure.png).startswith(PNG_MAGIC)
    line = figure.chart  # the chart data E2B's e2b-charts would give, as the SDK parses it
    assert isinstance(line, LineChart) and line.type == ChartType.LINE
    assert (line.title, line.x_label, line.x_unit, line.x_scale) == (
        "Squares", "Time (s)", "s", "linear")
    [squares] = line.elements
    assert squares.label == "squares" and squares.points == [(1, 1), (2, 4), (3, 9)]
    assert line.x_ticks and all(isinstance(t, float) for t in line.x_ticks)
    bars = sbx.run_code(
        "plt.bar(['a', 'b', 'c'], [3, 1, 2], label='counts')\nplt.ylabel('n')\nplt.show()")
    [figure] = bars.results
    assert base64.b64decode(figure.png).startswith(PNG_MAGIC)
    assert isinstance(figure.chart, BarChart) and figure.chart.type == ChartType.BAR
    assert figure.chart.y_label == "n" and figure.chart.title is None
    assert [(b.label, b.value, b.group) for b in figure.chart.elements] == [
        ("a", 3, "counts"), ("b", 1, "counts"), ("c", 2, "counts")]
    html = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    assert html.results[0].is_main_result
    assert "<table" in (html.results[0].html or "")
    shown = sbx.run_code("from IPython.display import Markdown, display\n"
                         "display(Markdown('# hi'))\n{'k': 1}")
    assert shown.results[0].markdown == "# hi" and not shown.results[0].is_main_result
    assert shown.text == "{'k': 1}"


def test_dataframe_data_and_a_saved_image(sbx: Sandbox) -> None:
    """A DataFrame's columns as `result.data`; a PIL image saved to a file is displayed, as
    E2B's test_data.py and images/test_images.py::test_get_image_on_save check."""
    frame = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})")
    assert frame.results[0].data == {"a": [1, 2, 3], "b": ["x", "y", "z"]}
    assert sbx.run_code("1 + 1").results[0].data is None
    saved = sbx.run_code(
        "import numpy\nfrom PIL import Image\n"
        "a = (numpy.random.rand(16, 16, 3) * 255).astype('uint8')\n"
        "Image.fromarray(a).convert('RGBA').save('/tmp/aenv-saved.png')\nprint('saved')")
    assert saved.error is None, saved.error
    [image] = saved.results
    assert base64.b64decode(image.png).startswith(PNG_MAGIC)
    assert saved.logs.stdout == ["saved\n"]
    assert sbx.files.read("/tmp/aenv-saved.png", format="bytes").startswith(PNG_MAGIC)


def test_exception_gives_name_value_traceback(sbx: Sandbox) -> None:
    execution = sbx.run_code("def f():\n    raise ValueError('bad value')\nf()")
    assert execution.error is not None
    assert execution.error.name == "ValueError"
    assert execution.error.value == "bad value"
    plain = ANSI.sub("", execution.error.traceback)  # IPython colours it, as E2B's does
    assert "raise ValueError('bad value')" in plain and "ValueError: bad value" in plain


def test_sandbox_env_vars_reach_every_kernel(ci_node: NodeProcess) -> None:
    """Sandbox.create's envs are in every context's kernel (started in the template, before
    they existed), a per-call env var of the same name is put back to the sandbox's value, as
    E2B's env_vars/test_*.py::test_env_vars_on_sandbox and test_env_vars_overwrite check."""
    sandbox = Sandbox.create(timeout=600, envs={"AENV_SBX_VAR": "from-create"})
    try:
        py = "import os\nos.environ.get('AENV_SBX_VAR', 'unset')"
        assert sandbox.run_code(py).text == "from-create"
        assert sandbox.run_code(py, envs={"AENV_SBX_VAR": "per-call"}).text == "per-call"
        assert sandbox.run_code(py).text == "from-create"
        js = "process.env.AENV_SBX_VAR || 'unset'"
        assert sandbox.run_code(js, language="js").text == "from-create"
        bash = sandbox.run_code("echo ${AENV_SBX_VAR:-unset}", language="bash")
        assert bash.logs.stdout == ["from-create\n"]
        ctx = sandbox.create_code_context(cwd="/tmp")
        assert sandbox.run_code(py, context=ctx).text == "from-create"
    finally:
        sandbox.kill()


def test_timeout_interrupts_and_the_next_call_works(sbx: Sandbox) -> None:
    sbx.run_code("y = 41")
    with pytest.raises(TimeoutException):
        sbx.run_code("while True:\n    pass", timeout=3)
    assert sbx.run_code("y + 1").text == "42"


def test_env_vars_per_call(sbx: Sandbox) -> None:
    code = "import os\nstr(os.environ.get('AENV_CI_VAR'))"
    # (a string's repr comes as the string, as from E2B's server)
    assert sbx.run_code(code, envs={"AENV_CI_VAR": "set"}).text == "set"
    assert sbx.run_code(code).text == "None"


def test_contexts(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context(cwd="/tmp")
    assert ctx.cwd == "/tmp" and ctx.language == "python"
    assert sbx.run_code("import os\nos.getcwd()", context=ctx).text == "/tmp"
    sbx.run_code("z = 7", context=ctx)
    assert sbx.run_code("z", context=ctx).text == "7"
    assert sbx.run_code("'z' in globals()").text == "False"  # the default context is another
    assert ctx.id in {c.id for c in sbx.list_code_contexts()}
    sbx.restart_code_context(ctx)
    assert sbx.run_code("z", context=ctx).error.name == "NameError"
    sbx.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sbx.list_code_contexts()}


def test_cells_are_roots_as_on_e2b(sbx: Sandbox) -> None:
    """E2B's template runs Jupyter and so every kernel as root (a systemd service with no
    User=), in /home/user unless a context names a cwd, and the SDKs name no other user: a
    context in /root works (E2B's test_contexts.py::test_create_context_with_options), a cell
    is root's with root's home, what it writes is root's; the sandbox's own commands stay
    `user`'s. (Before, our kernels ran as `user`: the /root context was a 400.)"""
    who = sbx.run_code("import os, getpass\n"
                       "(os.getuid(), getpass.getuser(), os.path.expanduser('~'), os.getcwd())")
    assert who.error is None, who.error
    assert who.text == "(0, 'root', '/root', '/home/user')"
    wrote = sbx.run_code("open('/home/user/aenv-by-a-cell.txt', 'w').write('cell')")
    assert wrote.error is None, wrote.error
    info = sbx.files.get_info("/home/user/aenv-by-a-cell.txt")
    assert (info.owner, info.group) == ("root", "root")
    assert sbx.files.read("/home/user/aenv-by-a-cell.txt") == "cell"
    assert sbx.commands.run("whoami").stdout == "user\n"

    ctx = sbx.create_code_context(cwd="/root")
    assert (ctx.cwd, ctx.language) == ("/root", "python")
    [listed] = [c for c in sbx.list_code_contexts() if c.id == ctx.id]
    assert listed.cwd == "/root"
    here = sbx.run_code("import os\nopen('in-root.txt', 'w').write('x')\nos.getcwd()",
                        context=ctx)
    assert here.error is None and here.text == "/root", here
    made = sbx.commands.run("stat -c %U:%G:%a /root/in-root.txt", user="root")
    assert made.stdout == "root:root:644\n"
    sbx.remove_code_context(ctx)

    assert sbx.run_code("process.getuid()", language="js").text == "0"
    shell = sbx.create_code_context(cwd="/root", language="bash")
    assert "".join(sbx.run_code("whoami; pwd", context=shell).logs.stdout) == "root\n/root\n"
    sbx.remove_code_context(shell)


def test_bash(sbx: Sandbox) -> None:
    """One bash per context: state and cwd kept, output streamed, a failing status an error,
    an interrupted command leaves the shell as it was, env vars for one call."""
    seen: list[tuple[str, str]] = []
    first = sbx.run_code(
        "n=41; greet() { echo \"hi $1\"; }; cd /tmp\necho one; echo two >&2; echo three",
        language="bash", on_stdout=lambda m: seen.append(("out", m.line)),
        on_stderr=lambda m: seen.append(("err", m.line)))
    assert first.error is None, first.error
    assert "".join(first.logs.stdout) == "one\nthree\n" and first.logs.stderr == ["two\n"]
    assert [line for kind, line in seen if kind == "out"] == first.logs.stdout
    again = sbx.run_code("greet $((n + 1)); pwd", language="bash")
    assert "".join(again.logs.stdout) == "hi 42\n/tmp\n"
    failed = sbx.run_code("ls /nonexistent", language="bash")
    assert failed.error is not None and failed.error.value == "2"
    assert "nonexistent" in failed.error.traceback
    with pytest.raises(TimeoutException):
        sbx.run_code("sleep 600; echo never", language="bash", timeout=3)
    assert sbx.run_code("echo $n", language="bash").logs.stdout == ["41\n"]
    assert sbx.run_code("echo $FOO", language="bash", envs={"FOO": "b a r"}).logs.stdout == [
        "b a r\n"]
    assert sbx.run_code("echo ${FOO:-unset}", language="bash").logs.stdout == ["unset\n"]
    ctx = sbx.create_code_context(cwd="/var", language="bash")
    assert ctx.language == "bash"
    # two commands' output: one chunk or two, as the shell's writes reach the kernel
    assert "".join(sbx.run_code("pwd; echo ${n:-fresh}", context=ctx).logs.stdout) == \
        "/var\nfresh\n"
    sbx.remove_code_context(ctx)


def test_javascript(sbx: Sandbox) -> None:
    """One Node.js per context: declarations kept, console streamed, the last expression the
    result, top-level await and imports, errors, interrupts, env vars for one call."""
    seen: list[str] = []
    first = sbx.run_code(
        "let total = 40; function add(a, b) { return a + b }\n"
        "console.log('one'); console.error('two'); console.log('three')\nadd(total, 2)",
        language="js", on_stdout=lambda m: seen.append(m.line))
    assert first.error is None, first.error
    assert "".join(first.logs.stdout) == "one\nthree\n" and first.logs.stderr == ["two\n"]
    assert seen == first.logs.stdout and first.text == "42"
    assert sbx.run_code("add(total, 1)", language="javascript").text == "41"
    assert sbx.run_code("await Promise.resolve('done')", language="js").text == "done"
    imported = sbx.run_code(
        "import { readFileSync } from 'fs'\nconst os = await import('os')\n"
        "console.log(typeof readFileSync, typeof os.cpus)\nprocess.cwd()", language="js")
    assert imported.logs.stdout == ["function function\n"] and imported.text == "/home/user"
    assert sbx.run_code("typeof readFileSync", language="js").text == "function"
    failed = sbx.run_code("function f() { throw new RangeError('too far') }\nf()",
                          language="js")
    assert failed.error is not None
    assert (failed.error.name, failed.error.value) == ("RangeError", "too far")
    assert "RangeError: too far" in failed.error.traceback and "at f" in failed.error.traceback
    with pytest.raises(TimeoutException):
        sbx.run_code("while (true) {}", language="js", timeout=3)
    assert sbx.run_code("total", language="js").text == "40"
    assert sbx.run_code("process.env.FOO", language="js", envs={"FOO": "bar"}).text == "bar"
    assert sbx.run_code("process.env.FOO || 'unset'", language="js").text == "unset"


@pytest.fixture(scope="module")
def langs_sbx(ci_node: NodeProcess) -> Iterator[Sandbox]:
    """A sandbox with env vars of its own for the TypeScript, R and Java tests (kernels that
    start on first use: each starts once, in this sandbox)."""
    sandbox = Sandbox.create(timeout=900, envs={"AENV_SBX_VAR": "from-create"})
    yield sandbox
    sandbox.kill()


def timed(what: str, call: Callable[[], T]) -> T:
    t0 = time.monotonic()
    try:
        return call()
    finally:
        print(f"\n{what}: {time.monotonic() - t0:.2f} s")


def test_typescript(langs_sbx: Sandbox) -> None:
    """`ts` (and `typescript`): the JavaScript kernel with each cell transpiled by TypeScript
    (types stripped, not checked, as in E2B's Deno kernel), as E2B's test_default_kernels.py,
    test_cwd.py and the env-var tests check."""
    sbx = langs_sbx
    first = timed("first TypeScript cell (kernel start)", lambda: sbx.run_code(
        "const message: string = 'Hello, World!'; console.log(message);", language="ts"))
    assert first.error is None, first.error
    assert first.logs.stdout == ["Hello, World!\n"]
    assert sbx.run_code("process.cwd()", language="typescript").text == "/home/user"
    typed = sbx.run_code(
        "interface P { x: number }\nenum E { A, B }\n"
        "function twice(p: P): number { return p.x * 2 }\ntwice({ x: 20 }) + E.B * 2",
        language="ts")
    assert typed.error is None and typed.text == "42", typed
    # not type-checked: a cell that would not compile under tsc runs
    assert sbx.run_code("let loose: number = 'a' as any; loose", language="ts").text == "a"
    imported = sbx.run_code("import { readFileSync } from 'fs'\n"
                            "await Promise.resolve<string>(typeof readFileSync)", language="ts")
    assert imported.text == "function", imported
    bad = sbx.run_code("const x: number = ;", language="ts")
    assert bad.error is not None and bad.error.name == "SyntaxError"
    assert "Expression expected" in bad.error.value
    thrown = sbx.run_code("throw new TypeError('nope')", language="ts")
    assert (thrown.error.name, thrown.error.value) == ("TypeError", "nope")
    env = "process.env.AENV_SBX_VAR"
    assert sbx.run_code(env, language="ts").text == "from-create"
    assert sbx.run_code(env, language="ts", envs={"AENV_SBX_VAR": "per-call"}).text == \
        "per-call"
    assert sbx.run_code(env, language="ts").text == "from-create"
    # its own kernel: the JavaScript context does not see TypeScript's globals
    assert sbx.run_code("typeof twice", language="js").text == "undefined"


def test_r(langs_sbx: Sandbox) -> None:
    """`r`: Debian's IRkernel, as E2B's test_default_kernels.py, test_cwd.py and
    env_vars/test_r.py check (values as display data: `results[0].text`)."""
    sbx = langs_sbx
    hello = timed("first R cell (kernel start)",
                  lambda: sbx.run_code('print("Hello, World!")', language="r"))
    assert hello.error is None, hello.error
    assert hello.logs.stdout == ['[1] "Hello, World!"\n']
    assert sbx.run_code("getwd()", language="r").results[0].text == '[1] "/home/user"'
    assert sbx.run_code('Sys.getenv("AENV_SBX_VAR")', language="r").results[0].text == \
        '[1] "from-create"'
    per_call = sbx.run_code('Sys.getenv("FOO")', language="r", envs={"FOO": "b\"a r"})
    assert per_call.results[0].text == '[1] "b\\"a r"'
    assert sbx.run_code('Sys.getenv("FOO", unset = "default")', language="r").results[0].text \
        == '[1] "default"'
    over = sbx.run_code('Sys.getenv("AENV_SBX_VAR")', language="r",
                        envs={"AENV_SBX_VAR": "per-call"})
    assert over.results[0].text == '[1] "per-call"'
    assert sbx.run_code('Sys.getenv("AENV_SBX_VAR")', language="r").results[0].text == \
        '[1] "from-create"'
    sbx.run_code("x <- c(1, 2, 3)", language="r")
    frame = sbx.run_code("data.frame(a = x * 2)", language="r")
    assert "<table" in (frame.results[0].html or ""), frame
    failed = sbx.run_code('stop("bad value")', language="r")
    assert failed.error is not None and "bad value" in failed.error.value
    with pytest.raises(TimeoutException):
        sbx.run_code("while (TRUE) {}", language="r", timeout=3)
    assert sbx.run_code("sum(x)", language="r").results[0].text == "[1] 6"


def test_java(langs_sbx: Sandbox) -> None:
    """`java`: our JShell kernel (Debian's OpenJDK 17), answering as E2B's IJava does, as E2B's
    test_default_kernels.py, test_cwd.py and env_vars/test_java.py check: a value's toString()
    as the result, each write to System.out its own stdout message, env vars as system
    properties. One JVM for the whole test."""
    sbx = langs_sbx
    hello = timed("first Java cell (kernel start)", lambda: sbx.run_code(
        'System.out.println("Hello, World!")', language="java", timeout=280))
    assert hello.error is None, hello.error
    assert hello.logs.stdout[0] == "Hello, World!" and "".join(hello.logs.stdout) == \
        "Hello, World!\n"
    assert sbx.run_code('System.getProperty("user.dir")', language="java").text == "/home/user"
    prop = 'System.getProperty("AENV_SBX_VAR")'
    assert sbx.run_code(prop, language="java").text == "from-create"
    assert sbx.run_code(prop, language="java", envs={"AENV_SBX_VAR": "per-call"}).text == \
        "per-call"
    assert sbx.run_code(prop, language="java").text == "from-create"
    assert sbx.run_code('System.getProperty("FOO")', language="java",
                        envs={"FOO": "bar"}).text == "bar"
    assert sbx.run_code('System.getProperty("FOO", "default")', language="java").text == \
        "default"
    state = sbx.run_code("int n = 41;\nString twice(String s) { return s + s; }\n"
                         "import java.util.*;\nvar l = new ArrayList<>(List.of(n, n + 1)); l",
                         language="java")
    assert state.error is None and state.text == "[41, 42]", state
    assert sbx.run_code('twice("ab") + (n + 1)', language="java").text == "abab42"
    thrown = sbx.run_code("int zero = 0;\nn / zero", language="java")
    assert thrown.error is not None
    assert (thrown.error.name, thrown.error.value) == ("java.lang.ArithmeticException",
                                                        "/ by zero")
    bad = sbx.run_code("String s = ;", language="java")
    assert bad.error is not None and bad.error.name == "CompilationException"
    with pytest.raises(TimeoutException):
        sbx.run_code("while (true) {}", language="java", timeout=5)
    assert sbx.run_code("n", language="java").text == "41"


def test_trivial_run_code_against_a_command(sbx: Sandbox) -> None:
    """Timings for the report (no assertion on them)."""
    runs, cmds = [], []
    for _ in range(10):
        t0 = time.monotonic()
        sbx.run_code("1")
        runs.append(time.monotonic() - t0)
        t0 = time.monotonic()
        sbx.commands.run("true")
        cmds.append(time.monotonic() - t0)
    print(f"\nrun_code('1') p50 {sorted(runs)[5] * 1000:.1f} ms; "
          f"commands.run('true') p50 {sorted(cmds)[5] * 1000:.1f} ms")


def test_pause_and_connect_keep_the_kernel_state(ci_node: NodeProcess) -> None:
    sandbox = Sandbox.create(timeout=600)
    try:
        sandbox.run_code("kept = 'before pause'")
        sandbox.pause()
        again = Sandbox.connect(sandbox.sandbox_id, timeout=600)
        assert again.run_code("kept").text == "before pause"
    finally:
        sandbox.kill()


def test_fork_children_keep_the_kernel_state_and_diverge(sbx: Sandbox) -> None:
    sbx.run_code("shared = [1]")
    forked = sbx.fork(count=3, timeout=600)
    assert all(isinstance(c, Sandbox) for c in forked), forked
    children = [Sandbox.connect(c.sandbox_id, timeout=600) for c in forked]
    try:
        for i, child in enumerate(children):
            child.run_code(f"shared.append({i})")
        assert [c.run_code("shared").text for c in children] == ["[1, 0]", "[1, 1]", "[1, 2]"]
        assert sbx.run_code("shared").text == "[1]"
    finally:
        for child in children:
            child.kill()


def test_a_snapshot_keeps_the_kernel_state(sbx: Sandbox) -> None:
    sbx.run_code("snapped = 'in the snapshot'")
    snap = sbx.create_snapshot()
    fresh = Sandbox.create(snap.snapshot_id, timeout=600)
    try:
        assert fresh.run_code("snapped").text == "in the snapshot"
    finally:
        fresh.kill()


def test_async_client_on_concurrent_sandboxes(ci_node: NodeProcess) -> None:
    async def main() -> list[str | None]:
        boxes = await asyncio.gather(*(AsyncSandbox.create(timeout=600) for _ in range(8)))
        try:
            runs = await asyncio.gather(*(b.run_code(f"{i} * 10") for i, b in enumerate(boxes)))
            return [r.text for r in runs]
        finally:
            await asyncio.gather(*(b.kill() for b in boxes))

    assert asyncio.run(main()) == [str(i * 10) for i in range(8)]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Internet]:
    with internet(LAB_PREFIX, LAB_SUBNET, tmp_path_factory.mktemp("lab")) as net:
        yield net


@pytest.mark.root
def test_the_egress_policy_holds_for_the_kernels_traffic(ci_node: NodeProcess,
                                                         lab: Internet) -> None:
    """A cell's own connections leave the guest like a command's: the sandbox's deny_out
    refuses one lab host, the other answers; the same for a Bash cell."""
    fetch = (
        "import urllib.request\n"
        "def get(url):\n"
        "    try:\n"
        "        return str(urllib.request.urlopen(url, timeout=5).status)\n"
        "    except Exception as exc:\n"
        "        return type(exc).__name__\n"
        f"print(get('{lab.url(lab.host_a)}'), get('{lab.url(lab.host_b)}'))\n")
    sandbox = Sandbox.create(timeout=600, network={"deny_out": [lab.host_a]})
    try:
        execution = sandbox.run_code(fetch)
        assert execution.error is None, execution.error
        denied, allowed = "".join(execution.logs.stdout).split()
        assert denied in ("URLError", "TimeoutError") and allowed == "200", execution.logs
        shell = sandbox.run_code(
            f"curl -s -o /dev/null -m 5 -w '%{{http_code}}' {lab.url(lab.host_a)}; echo \" $?\";"
            f" curl -s -o /dev/null -m 5 -w '%{{http_code}}' {lab.url(lab.host_b)}",
            language="bash")
        code_a, exit_a, code_b = "".join(shell.logs.stdout).split()
        assert (code_a, code_b) == ("000", "200") and exit_a != "0", shell.logs
    finally:
        sandbox.kill()


def test_js_sdk_basic_cases(ci_node: NodeProcess, tmp_path: Path) -> None:
    """The JS SDK, as a user runs it: state kept between calls, the stdout callback in order,
    an exception's name/value/traceback, a context with a cwd, a matplotlib plot's png."""
    modules = npm_pinned.install(JS_DIR, "@e2b/code-interpreter", tmp_path)
    done = subprocess.run(
        [npm_pinned.tool("node"), str(JS_DIR / "code_interpreter.mjs")],
        capture_output=True, text=True, timeout=300,
        env=npm_pinned.sdk_env(ci_node.url, ci_node.api_key, modules))
    assert done.returncode == 0, f"JS SDK run failed:\n{done.stdout}\n{done.stderr}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])

    pinned = json.loads((JS_DIR / "package.json").read_text())["dependencies"]
    assert seen["sdkVersion"] == pinned["@e2b/code-interpreter"]
    assert seen["assign"] == {"error": None, "results": 0}
    assert seen["sum"] == {"text": "2", "error": None}
    assert seen["counts"][1] == seen["counts"][0] + 1
    # the callbacks get what the logs keep, in order (a chunk may hold one line or several)
    assert "".join(seen["logs"]["stdout"]) == "line 0\nline 1\nline 2\n"
    assert seen["logs"]["stderr"] == ["oops\n"]
    assert [line for kind, line in seen["callbacks"] if kind == "out"] == seen["logs"]["stdout"]
    assert [line for kind, line in seen["callbacks"] if kind == "err"] == ["oops\n"]
    error = seen["error"]
    assert (error["name"], error["value"]) == ("ValueError", "bad value")
    plain = ANSI.sub("", error["traceback"])
    assert "raise ValueError('bad value')" in plain and "ValueError: bad value" in plain
    assert seen["context"] == {"cwd": "/tmp", "language": "python"}
    assert (seen["cwdInContext"], seen["zInContext"], seen["zInDefault"]) == ("/tmp", "7", "False")
    assert (seen["listedBefore"], seen["listedAfter"]) == (True, False)
    assert seen["plot"]["error"] is None
    [figure] = seen["plot"]["results"]
    assert "png" in figure["formats"] and bytes.fromhex(figure["pngMagic"]) == PNG_MAGIC
    assert figure["chartTitle"] == "Squares"
