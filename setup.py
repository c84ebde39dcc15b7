"""The native serving core (docs/native.md): a C++ extension built by `pip install -e .`."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "agentenv.storage._native",
            ["src/agentenv/storage/_native.cpp"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                                "-fvisibility=hidden"],
        )
    ]
)
