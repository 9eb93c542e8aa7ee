"""Builds kvforge's C kernels (src/kvforge/ops/kernels/*.c) into one shared library when kvforge is
installed; everything else is in pyproject.toml.

The library needs no Python or torch headers (kvforge calls it through ctypes with raw pointers),
so pip's isolated build environment, which holds setuptools alone, builds it. It is compiled for
AVX-512 (and AMX where the compiler knows it) whatever the building CPU has; its `kvforge_supported`,
compiled without those flags, tells at run time whether this CPU can run it. A failed build (no C
compiler, one too old) does not fail the install: kvforge then runs torch's ops and says so once.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = "kvforge.ops.kernels._kvforge_kernels"
DIR = "src/kvforge/ops/kernels/"
SOURCES = [DIR + name for name in ("few_query_attention.c", "small_linear.c", "rms_norm.c", "silu_mul.c", "threads.c")]
AVX512 = ["-O3", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]
# The AMX build first; a compiler without AMX intrinsics (gcc < 11) builds the rest alone.
BUILDS = [(SOURCES + [DIR + "small_linear_amx.c"], ["-mamx-tile", "-mamx-bf16"]), (SOURCES, ["-DKVFORGE_NO_AMX"])]


def sources_hash(directory: Path) -> str:
    """The kernels' sources, hashed; the library carries it (`kvforge_sources`) and
    `kvforge.ops.kernels` refuses a library built from other sources (an editable install whose
    `.c` or `.h` files changed since)."""
    h = hashlib.sha256()
    for path in sorted(directory.glob("*.[ch]")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


class BuildKernels(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if ext.name != KERNELS:
            return super().build_extension(ext)
        target = self.get_ext_fullpath(ext.name)
        errors = []
        for sources, extra in BUILDS:
            try:
                check = self.compiler.compile([DIR + "cpu_check.c"], output_dir=self.build_temp, extra_postargs=["-O2", "-fPIC"],
                                              macros=[("KVFORGE_SOURCES", f'"{sources_hash(Path(DIR))}"')])
                objects = self.compiler.compile(sources, output_dir=self.build_temp, extra_postargs=[*AVX512, *extra])
                self.compiler.link_shared_object(check + objects, target)
                return
            except Exception as exc:  # noqa: BLE001 (CompileError, LinkError, a missing compiler: all leave torch's ops)
                errors.append(str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        print(f"warning: kvforge's C kernels were not built ({'; '.join(errors)}): bf16 runs torch's ops", file=sys.stderr)


setup(ext_modules=[Extension(KERNELS, sources=[], optional=True)], cmdclass={"build_ext": BuildKernels})
