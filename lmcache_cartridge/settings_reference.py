"""The settings read outside LMCache's `extra_config`: the connector's `kv_connector_extra_config`
keys and the `LMCACHE_CARTRIDGE_*` environment variables, one record each (name, type, default,
meaning).

The one list: the code that reads a setting takes its name and default from here, and
docs/configuration.md is generated from these tables (with the plugin's, `lmcache.settings`), so
the reference cannot drift; `tests/test_config_reference.py` also fails on a `"cartridge.*` key or
an `LMCACHE_CARTRIDGE_*` name in the package that has no row. Shared by every stage (the paths,
the store's metrics, the vLLM connector and CPU copy, the gateway inside vLLM), so it imports
nothing of the package. Runs in every process; constants only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """One setting. `default`: what its reader falls back to, as written where it is set (a YAML or
    JSON value, an environment string); None: unset; "(...)": one the reader computes."""

    name: str
    type: str
    default: Any
    meaning: str

    def default_cell(self) -> str:
        if self.default is None or self.default == "":
            return "(unset)"
        if isinstance(self.default, bool):
            return str(self.default).lower()
        return str(self.default)


def table(rows, first: str = "key") -> str:
    """A Markdown table of `rows` (Settings), as docs/configuration.md shows them."""
    out = [f"| {first} | type | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{r.name}` | {r.type} | {r.default_cell()} | {r.meaning} |" for r in rows]
    return "\n".join(out) + "\n"


# --- the connector: vLLM's `kv_connector_extra_config` (`vllm.connector`) ----------------------
READY_TIMEOUT = Setting(
    "cartridge.ready_timeout_s", "float", 30.0,
    "seconds a request carrying a trained cartridge waits on this instance for its KV, then fails")
FIRST_K_WAIT = Setting(
    "cartridge.first_k_wait_s", "float", 2.0,
    "seconds a request whose prompt starts with cartridge tokens (first-k, or past a trained "
    "cartridge's) waits on this instance while LMCache finds less of their KV than the cartridges "
    "hold (another request's load of the same chunks in flight), asking again every 0.25 s; then "
    "it is computed as usual. 0: no wait")
KEEP_LOAD_FAILURE_POLICY = Setting(
    "cartridge.keep_load_failure_policy", "bool", False,
    "leave vLLM's `kv_load_failure_policy` as configured, without the per-request one (trained: "
    "fail, first-k: recompute)")
KV_EVENTS_PERIOD = Setting(
    "cartridge.kv_events_period_s", "float", 1.0,
    "seconds between scans for resident cartridges to announce as KV events (`--kv-events-config`)")
KV_EVENTS_REANNOUNCE = Setting(
    "cartridge.kv_events_reannounce_s", "float", 30.0,
    "seconds after which every resident cartridge is announced again (for late subscribers)")
MP_CACHE_DIR = Setting(
    "cartridge.cache_dir", "path", "<cache root>/cache",
    "LMCache MP mode (`CartridgeMPConnector`): the `cache_dir` of the attached `lmcache server`'s "
    "cartridge adapter, whose serving-state record says which cartridges to announce as KV events "
    "and which registry a gateway's composites are built into")
CONNECTOR_KEYS: tuple[Setting, ...] = (READY_TIMEOUT, FIRST_K_WAIT, KEEP_LOAD_FAILURE_POLICY, KV_EVENTS_PERIOD,
                                       KV_EVENTS_REANNOUNCE, MP_CACHE_DIR)

# --- the environment -----------------------------------------------------------------------------
# Every process
HOME = Setting(
    "LMCACHE_CARTRIDGE_HOME", "path", "~/.cache/lmcache_cartridge",
    "the cache root: the default registry (`registry.db`) and cache dir (`cache/`), models, the "
    "native kernel; the CLI and the server alike")
INSTANCE = Setting(
    "LMCACHE_CARTRIDGE_INSTANCE", "str", "(the host name)",
    "this server's `cartridge_instance` label on the metrics (its name in a fleet)")
API_KEYS = Setting(
    "LMCACHE_CARTRIDGE_API_KEYS", "list", None,
    "the gateway's client keys, comma-separated, 16+ characters each (with `--api-key`); also the "
    "middleware's")
# The gateway inside vLLM's API server (`api.middleware`): the `gateway` command's options
MODEL = Setting(
    "LMCACHE_CARTRIDGE_MODEL", "str", None,
    "middleware: the served model name where vLLM's arguments cannot be read (they win otherwise)")
TOKENIZER = Setting(
    "LMCACHE_CARTRIDGE_TOKENIZER", "path", "(vLLM's `--tokenizer`, else `--model`)",
    "middleware: `gateway --tokenizer`, a local tokenizer directory")
ALLOW_LOCAL = Setting(
    "LMCACHE_CARTRIDGE_ALLOW_LOCAL", "list", None,
    "middleware: `gateway --allow-local`, directories (comma- or `:`-separated) local cartridges may come from")
ALLOW_S3 = Setting(
    "LMCACHE_CARTRIDGE_ALLOW_S3", "list", None,
    "middleware: `gateway --allow-s3`, buckets or prefixes (comma-separated) clients may name")
TENANTS = Setting(
    "LMCACHE_CARTRIDGE_TENANTS", "path", None,
    "middleware: `gateway --tenants`, a YAML file of tenants")
MAX_CARTRIDGES = Setting(
    "LMCACHE_CARTRIDGE_MAX_CARTRIDGES", "int", "4",
    "middleware: `gateway --max-cartridges`, most cartridges per request")
MAX_BODY_BYTES = Setting(
    "LMCACHE_CARTRIDGE_MAX_BODY_BYTES", "int", "4194304",
    "middleware: `gateway --max-body-bytes`, largest request body")
MAX_CACHE_BYTES = Setting(
    "LMCACHE_CARTRIDGE_MAX_CACHE_BYTES", "int", "68719476736",
    "middleware: `gateway --max-cache-bytes`, S3 inputs and conversions kept under the cache dir")
SERVE_TIMEOUT = Setting(
    "LMCACHE_CARTRIDGE_SERVE_TIMEOUT", "float", "15.0",
    "middleware: `gateway --serve-timeout`, seconds to wait for the plugins to serve a new cartridge")
FORCE_REDOWNLOAD_INTERVAL = Setting(
    "LMCACHE_CARTRIDGE_FORCE_REDOWNLOAD_INTERVAL", "float", "60.0",
    "middleware: `gateway --force-redownload-interval`, seconds between honoured `force_redownload`s "
    "of a cartridge (0: refused)")
TRAINED_CHAT_TEMPLATE = Setting(
    "LMCACHE_CARTRIDGE_TRAINED_CHAT_TEMPLATE", "path or `model`", None,
    "middleware: `gateway --trained-chat-template`, chat prompts after a trained cartridge")
# The CPU copy into and out of vLLM-CPU's KV cache (`vllm.cpu_kv`, `vllm.native`)
NATIVE = Setting(
    "LMCACHE_CARTRIDGE_NATIVE", "`0` or `1`", "1",
    "`0`: the copies into and out of vLLM-CPU's KV cache run in pure torch, not the C kernel")
ENGINE_BLOCKS = Setting(
    "LMCACHE_CARTRIDGE_ENGINE_BLOCKS", "`0` or `1`", "1",
    "`0`: on vLLM-CPU, LMCache's memory objects stay `KV_2LTD` where they could hold vLLM's blocks")
PARALLEL_MIN_BYTES = Setting(
    "LMCACHE_CARTRIDGE_PARALLEL_MIN_BYTES", "int", "1048576",
    "on vLLM-CPU, copies of at least this many bytes are split over threads")
# The test suite and the harness that starts servers (`tools.starts`)
TEST_REPORT = Setting(
    "LMCACHE_CARTRIDGE_TEST_REPORT", "path", None,
    "a directory: every vLLM, `lmcache server` and vllm-router start is recorded there "
    "(`starts.jsonl`), and the test suite writes its per-module times (`summary.md`; `make test` sets it)")
ENV_VARS: tuple[Setting, ...] = (
    HOME, INSTANCE, API_KEYS,
    MODEL, TOKENIZER, ALLOW_LOCAL, ALLOW_S3, TENANTS, MAX_CARTRIDGES, MAX_BODY_BYTES, MAX_CACHE_BYTES,
    SERVE_TIMEOUT, FORCE_REDOWNLOAD_INTERVAL, TRAINED_CHAT_TEMPLATE,
    NATIVE, ENGINE_BLOCKS, PARALLEL_MIN_BYTES, TEST_REPORT,
)
