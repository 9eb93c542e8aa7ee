"""The kernels' library as installed: found where setup.py builds it, its absence announced once
and recorded, its CPU check safe to run on any x86-64 CPU. Runs on every CPU (test_kernels.py
tests the kernels themselves where they run)."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch

from kvforge.ops import kernels
from kvforge.provenance import machine


@pytest.fixture
def fresh_library():
    kernels.reload()
    yield
    kernels.reload()


def test_a_library_that_was_not_built_is_announced_once_and_recorded(monkeypatch, capsys, fresh_library):
    monkeypatch.setattr(kernels, "multiplies_natively", lambda name: True)  # a CPU the kernels would run on
    monkeypatch.setattr(kernels, "_NAME", "_kvforge_kernels_never_built")
    monkeypatch.delenv("KVFORGE_KERNELS", raising=False)
    assert not kernels.available(64) and not kernels.small_linear_fits(torch.zeros(16, 16, dtype=torch.bfloat16))
    assert not kernels.available(128)
    assert capsys.readouterr().err.count("kvforge's C kernels are missing: not built when kvforge was installed") == 1
    assert kernels.status() == {"kernels": "none", "why_not": kernels._loaded()[1], "kernel_threads": None}
    assert machine()["kernels"] == "none" and machine()["why_not"].startswith("not built")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the kernels are built for x86-64")
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler: the install built no kernels")
def test_the_installed_library_loads_and_asks_the_cpu_itself(monkeypatch, capsys, fresh_library):
    """`make install` built it; loading it and running its CPU check is safe on a CPU without
    AVX-512 (the check is compiled without AVX-512 flags)."""
    monkeypatch.delenv("KVFORGE_KERNELS", raising=False)
    why = kernels._loaded()[1]
    assert why is None or why.startswith("this CPU lacks"), why
    flags = machine()["cpu_flags"]
    assert (why is None) == bool(flags["avx512_bf16"])
    kernels._library()
    assert capsys.readouterr().err == ""  # nothing missing: nothing announced


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the kernels are built for x86-64")
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler: the install built no kernels")
def test_a_library_built_from_other_sources_is_refused(monkeypatch, capsys, fresh_library):
    """An editable install whose .c files changed after the build: the stale library is not used."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvforge_setup", Path(kernels.__file__).parents[4] / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    monkeypatch.setattr("setuptools.setup", lambda **kwargs: None)
    spec.loader.exec_module(setup)
    here = Path(kernels.__file__).parent
    assert setup.sources_hash(here) == kernels._sources_hash(here)  # setup.py and the loader hash alike
    monkeypatch.setattr(kernels, "multiplies_natively", lambda name: True)
    monkeypatch.setattr(kernels, "_sources_hash", lambda directory: "0" * 16)
    assert kernels._library() is None and "built from other sources" in kernels.status()["why_not"]
    assert capsys.readouterr().err.count("built from other sources") == 1


def test_a_cpu_without_avx512_bf16_is_recorded_without_a_warning(monkeypatch, capsys, fresh_library):
    monkeypatch.setattr(kernels, "multiplies_natively", lambda name: False)
    assert kernels._library() is None and kernels.status()["why_not"].startswith("this CPU lacks")
    assert capsys.readouterr().err == ""


def test_every_tensor_must_be_on_the_cpu():
    """The kernels read raw pointers: a tensor elsewhere (here the meta device) is refused."""
    meta = torch.empty(1, 2, 1, 64, dtype=torch.bfloat16, device="meta")
    cpu = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CPU"):
        kernels.few_query_attention(meta, cpu, cpu, 4, 0.125)
    with pytest.raises(ValueError, match="CPU"):
        kernels.few_query_scores(meta, cpu, 4, 0.125)
