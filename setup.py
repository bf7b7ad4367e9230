"""Build of the shard's attention kernel (fastdecode.kv._attention), a torch C++ extension.

Metadata lives in pyproject.toml; this file only adds the extension. It is built when torch
is importable at build time (`make setup` installs torch==2.13.0 first, then this package with
--no-build-isolation, so the extension links the torch it will run with). Without torch (an
SDK-only install, or an isolated build env) the package installs without it and
`--attention-backend native` says so at start-up. FASTDECODE_NO_EXTENSION=1 skips it on purpose.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup


def _extension_build() -> dict[str, object]:
    if os.environ.get("FASTDECODE_NO_EXTENSION") == "1":
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("fastdecode: torch not importable at build time; skipping the native attention kernel")
        return {}
    # No -march: the AVX2+FMA+F16C path is compiled with a target pragma and picked from CPUID at
    # load time, so an image built on one x86 host runs on any other (scalar path below AVX2).
    # -fno-wrapv undoes the -fwrapv that setuptools copies from Python's own CFLAGS: with signed
    # overflow defined, the kernel's loops lose optimizations (bf16 decode took 1.065x the time of
    # the same source built without it, same run; 1.01x once this flag was added; 2026-12-03).
    flags = ["-O3", "-std=c++20", "-fopenmp", "-fno-math-errno", "-fno-wrapv", "-Wall"]
    ext = CppExtension(
        "fastdecode.kv._attention",
        ["fastdecode/kv/csrc/attention.cpp"],
        # included once per ISA path (amx_job.inc once): a change to either rebuilds
        depends=["fastdecode/kv/csrc/vec_job.inc", "fastdecode/kv/csrc/amx_job.inc"],
        extra_compile_args=flags,
        extra_link_args=["-fopenmp"],
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=False)}}


if __name__ == "__main__" or "setuptools" in sys.modules:
    setup(**_extension_build())
