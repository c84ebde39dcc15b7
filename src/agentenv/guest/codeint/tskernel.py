"""The TypeScript kernel of the code-interpreter server: the JavaScript kernel (jskernel.py) whose
evaluator transpiles each cell with TypeScript's transpileModule first (Debian's
node-typescript): types are stripped, not checked, as in E2B's TypeScript kernel (Deno's).

    python3 -m agentenv.guest.codeint.tskernel -f <connection file>
"""

from __future__ import annotations

from agentenv.guest.codeint.jskernel import JavaScriptKernel


class TypeScriptKernel(JavaScriptKernel):
    implementation = "agentenv-typescript"
    language_info = {"name": "typescript", "mimetype": "text/typescript",
                     "file_extension": ".ts"}
    start_seconds = 120.0  # Node.js loads TypeScript's compiler (11 MB of JavaScript) at start

    def child_env(self) -> dict[str, str]:
        return {**super().child_env(), "AENV_JS_TYPESCRIPT": "1"}


if __name__ == "__main__":
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(kernel_class=TypeScriptKernel)
