"""docs/configuration.md, generated: every setting the product reads, each table from the one its
readers use, so the page cannot drift (`tests/test_config_reference.py` compares).

The plugin's `extra_config` keys (`lmcache.settings.PLUGIN_KEYS`, `S3_KEYS` and `S3Settings`'
defaults), the connector's `kv_connector_extra_config` keys and LMCache's own there that matter
(`settings_reference`, `lmcache.settings.LMCACHE_CONNECTOR_KEYS`), the gateway's flags (the
`gateway` command's own parser), the tenants file (`api.settings.TenantsFile`) and the environment
variables (`settings_reference`). Here, in the last stage, because it reads them all.

    python -m lmcache_cartridge.tools.reference > docs/configuration.md
"""

from __future__ import annotations

import argparse
import re
from dataclasses import fields


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def gateway_flags() -> str:
    """A table of the `gateway` command's options, from its parser: flag, value, default, meaning,
    and the environment variable that stands for it inside vLLM's API server (the middleware)."""
    from lmcache_cartridge import settings_reference as ref
    from lmcache_cartridge.tools.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    gateway = sub.choices["gateway"]
    env_of = {}
    for var in ref.ENV_VARS:
        m = re.search(r"`gateway (--[\w-]+)`", var.meaning)
        if m:
            env_of[m.group(1)] = var.name
    env_of["--api-key"] = ref.API_KEYS.name
    rows = ["| flag | value | default | meaning | inside vLLM (middleware) |", "|---|---|---|---|---|"]
    for a in gateway._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        flag = max(a.option_strings, key=len)
        value = a.metavar or (a.type.__name__ if a.type else "str")
        if a.required:
            default = "(required)"
        elif flag == "--config":  # read from the environment when the parser is built
            default = "$LMCACHE_CONFIG_FILE"
        elif a.default is None:
            default = "(unset)"
        else:
            default = str(a.default)
        meaning = a.help or ""
        if isinstance(a, argparse._AppendAction):
            meaning += " (repeatable)" if "repeatable" not in meaning else ""
        env = env_of.get(flag)
        if flag in ("--upstream", "--host", "--port", "--registry", "--chunk-size", "--s3-endpoint", "--config"):
            env_cell = "(the server's own)"
        elif flag == "--model":
            env_cell = f"vLLM's `--served-model-name` / `--model` (else `{ref.MODEL.name}`)"
        elif flag == "--upstream-api-key":
            env_cell = "vLLM's own `--api-key`"
        else:
            env_cell = f"`{env}`" if env else "-"
        rows.append(f"| `{flag}` | {_cell(value)} | {_cell(default)} | {_cell(meaning)} | {env_cell} |")
    return "\n".join(rows) + "\n"


def tenants_file() -> str:
    """The tenants file's fields (from `TenantsFile` / `TenantEntry`) and its example."""
    from lmcache_cartridge.api.settings import TENANTS_EXAMPLE, TenantEntry

    rows = ["| field | type | required | meaning |", "|---|---|---|---|"]
    for name, f in TenantEntry.model_fields.items():
        kind = "list of strings" if str(f.annotation) == "list[str]" else "string"
        rows.append(f"| `{name}` | {kind} | {'yes' if f.is_required() else 'no'} | {_cell(f.description or '')} |")
    return "\n".join(rows) + "\n\n```yaml\n" + TENANTS_EXAMPLE + "```\n"


def reference() -> str:
    """The configuration reference (Markdown), docs/configuration.md whole."""
    from lmcache_cartridge import settings_reference as ref
    from lmcache_cartridge.lmcache.settings import LMCACHE_CONNECTOR_KEYS, PLUGIN_KEYS, S3_KEYS
    from lmcache_cartridge.settings_reference import Setting
    from lmcache_cartridge.store.s3 import S3Settings

    s3 = tuple(Setting(f"s3.{f.name}", S3_KEYS[f.name][0], f.default, S3_KEYS[f.name][1]) for f in fields(S3Settings))
    return "\n".join([
        "# Configuration reference",
        "",
        "Every setting lmcache_cartridge reads, generated from the tables its readers take names and",
        "defaults from (`lmcache_cartridge/lmcache/settings.py`, `lmcache_cartridge/settings_reference.py`,",
        "the `gateway` command's parser, `lmcache_cartridge/api/settings.py`):",
        "`python -m lmcache_cartridge.tools.reference > docs/configuration.md` writes this page, and",
        "`tests/test_config_reference.py` fails when it is stale or a setting the code reads has no row.",
        "`list`: comma-separated (in YAML also a list); `size`: bytes, or with a unit (`8MiB`).",
        "",
        "## The plugin: `extra_config` keys",
        "",
        "Every key under LMCache's `extra_config` as `storage_plugin.<name>.<key>` (`<name>`: the",
        "`storage_plugins` entry of the cartridge plugin). `lmcache-cartridge doctor` fails on any other",
        "key, and the plugin refuses to start on one: vLLM's log names the key meant, and vLLM runs",
        "without the plugin (every prompt prefilled). In LMCache's multiprocess mode the same keys,",
        "without the prefix, are the cartridge L2 adapter's `adapter_params` (`lmcache-cartridge mp-server`",
        "passes the YAML's; the server refuses to start on an unknown one).",
        "",
        ref.table(PLUGIN_KEYS + s3),
        "## The connector: `kv_connector_extra_config` keys",
        "",
        "Keys the cartridge connectors read from `kv_connector_extra_config` in vLLM's `--kv-transfer-config`",
        "(JSON values), e.g. `\"kv_connector_extra_config\": {\"cartridge.ready_timeout_s\": 60}`; LMCache's own",
        "keys there are LMCache's. `CartridgeConnector` (in-process) reads all but `cartridge.cache_dir` (its",
        "plugin's settings name the cache dir); `CartridgeMPConnector` (LMCache's multiprocess mode) reads them all.",
        "",
        ref.table(ref.CONNECTOR_KEYS),
        "LMCache's own keys there that serving cartridges depends on. They go in `kv_connector_extra_config`",
        "(where LMCache reads them), not in the LMCache YAML, e.g.",
        "`--kv-transfer-config '{\"kv_connector\": \"CartridgeConnector\", ..., \"kv_connector_extra_config\":",
        "{\"lmcache.max_tokens_per_load\": 0}}'`:",
        "",
        ref.table(LMCACHE_CONNECTOR_KEYS),
        "## The gateway: `lmcache-cartridge gateway` flags",
        "",
        "The standalone gateway's options (`lmcache-cartridge gateway --help` prints the same). Inside vLLM's",
        "API server (the middleware) each is the environment variable in the last column, or vLLM's own",
        "setting; `--config` is then the server's `$LMCACHE_CONFIG_FILE`.",
        "",
        gateway_flags(),
        "## The tenants file (`gateway --tenants`)",
        "",
        "A YAML file with one key, `tenants`: a list of tenants, each with these fields. A tenant's keys",
        "name only its own cartridges; the operator's keys (`--api-key`) see everything the gateway's roots",
        "allow. Unknown fields, a key under 16 characters, a key two tenants share or a relative local root",
        "are refused when the gateway starts, naming the tenant ([security](security.md)).",
        "",
        tenants_file(),
        "## Environment variables",
        "",
        "The `LMCACHE_CARTRIDGE_*` variables the package reads (LMCache's own `LMCACHE_*` variables and",
        "`LMCACHE_CONFIG_FILE` configure the plugin: see above). `middleware:` the gateway inside vLLM's",
        "API server (`--middleware lmcache_cartridge.api.middleware.CartridgeMiddleware`), where each",
        "stands for the `gateway` command's flag; an empty variable counts as unset.",
        "",
        ref.table(ref.ENV_VARS, "variable"),
    ])


if __name__ == "__main__":  # docs/configuration.md
    print(reference(), end="")
