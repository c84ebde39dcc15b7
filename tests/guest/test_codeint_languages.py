"""The code-interpreter server's languages (agentenv.guest.codeint): the names it takes for
TypeScript, R and Java, the 400 that lists them, the hidden cells that set env vars in R and
Java, and one start of a language's default context when calls for it come together (TypeScript,
R and Java start on first use). In-process, the kernels stood in for (test_codeint_auth); the VM
tests are tests/node/test_code_interpreter.py::test_typescript, test_r, test_java."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.guest.test_codeint_auth import (  # noqa: F401 (server is a fixture)
    FakeContext,
    client,
    codeint,
    digest_file,
    lines,
    run,
    server,
)


def test_typescript_r_and_java_are_served_and_listed() -> None:
    assert codeint.normalize_language("ts") == "typescript"
    assert codeint.normalize_language("TypeScript") == "typescript"
    assert codeint.normalize_language("r") == "r"
    assert codeint.normalize_language("java") == "java"
    try:
        codeint.normalize_language("cobol")
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("cobol was taken")
    assert "supported: bash, java, javascript, js, python, r, ts, typescript" in message


def test_env_var_cells_for_r_and_java() -> None:
    r = codeint.LANGUAGES["r"]
    env = {"FOO": 'b"a\\r', "É": "\u00e9\n"}
    assert r.env_apply(env) == \
        'invisible(Sys.setenv("FOO" = "b\\"a\\\\r", "\\U{c9}" = "\\U{e9}\\n"))'
    assert r.env_set(env).startswith(
        '.aenv_saved_env <- Sys.getenv(c("FOO", "\\U{c9}"), unset = NA, names = TRUE)\n')
    assert "rm(.aenv_saved_env)" in r.env_restore(env)
    java = codeint.LANGUAGES["java"]
    # the Java kernel's own commands, not Java
    assert java.env_set({"FOO": "bar"}) == '%aenv-properties-set {"FOO": "bar"}'
    assert java.env_restore({"FOO": "bar"}) == "%aenv-properties-restore"
    assert java.env_apply({"FOO": "bar"}) == '%aenv-properties-apply {"FOO": "bar"}'


class SlowStart(FakeContext):
    started: list[str] = []

    async def start(self) -> None:
        SlowStart.started.append(self.language)
        await asyncio.sleep(0.2)  # a JVM


def test_a_default_context_starts_once_for_concurrent_calls(
        server: Callable[[Path], codeint.CodeApp], tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    app = server(digest_file(tmp_path, None))
    monkeypatch.setattr(codeint, "Context", SlowStart)

    async def scenario() -> None:
        async with await client(app) as http:
            SlowStart.started = []
            calls = [http.post("/execute", json={"code": f"{i}", "language": "java"})
                     for i in range(3)]
            answers = await asyncio.gather(*calls)
            assert [a.status_code for a in answers] == [200, 200, 200]
            assert sorted(lines(a)[0]["text"] for a in answers) == ["0", "1", "2"]
            assert SlowStart.started == ["java"]
            listed = (await http.get("/contexts")).json()
            assert [c["language"] for c in listed].count("java") == 1
            wrong = await http.post("/execute", json={"code": "1", "language": "cobol"})
            assert wrong.status_code == 400 and "java" in wrong.json()["error"]

    run(scenario)
