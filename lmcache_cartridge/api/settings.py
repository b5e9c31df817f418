"""The gateway's settings and its client-error type. Runs in the gateway process; immutable."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lmcache_cartridge.settings_reference import API_KEYS


class RequestError(Exception):
    """A client mistake: becomes an HTTP 4xx with this message."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after  # seconds, sent as Retry-After (429, 503)


@dataclass(frozen=True)
class Tenant:
    """What the clients holding one set of API keys may name. `ids`: glob patterns over
    registered ids (a label resolves only among the ids they match); `local_roots` / `s3_roots`:
    as the gateway's `--allow-local` / `--allow-s3`, for this tenant alone. Another tenant's
    cartridges, and which ids exist, are invisible: a registered id or label outside `ids`
    answers exactly as one that does not exist."""

    name: str
    keys: tuple[str, ...] = field(default=(), repr=False)
    ids: tuple[str, ...] = ()
    local_roots: tuple[Path, ...] = ()
    s3_roots: tuple[str, ...] = ()

    def may_name(self, cartridge_id: str) -> bool:
        return any(fnmatch.fnmatchcase(cartridge_id, p) for p in self.ids)


@dataclass(frozen=True)
class GatewaySettings:
    upstream: str
    model: str                      # the upstream model name (vLLM --model): manifests must match it
    tokenizer: str                  # a local tokenizer directory (usually the model directory)
    registry: Path
    cache_dir: Path
    chunk_size: int = 256
    local_roots: tuple[Path, ...] = ()  # local cartridge paths must lie under one of these
    s3_roots: tuple[str, ...] = ()      # "bucket" or "bucket/prefix" clients may name (--allow-s3)
    s3: dict[str, str] = field(default_factory=dict)
    accept_models: tuple[str, ...] = ()  # other model names whose cartridges the plugin also serves
    # Chat prompts after a trained cartridge: None = the Cartridges rule (no BOS, no default
    # system block: the user turn right after the cartridge), "model" = the model's own template
    # (BOS dropped), or a Jinja chat template of the deployment's own.
    trained_chat_template: str | None = None
    max_cartridges: int = 4
    # `force_redownload` makes every instance drop and refetch a cartridge (an epoch bump): honoured
    # at most once per this many seconds per cartridge (429 with Retry-After in between); 0 refuses
    # it outright (403).
    force_redownload_interval: float = 60.0
    max_model_len: int | None = None   # None: asked of the upstream server once
    max_body_bytes: int = 4 << 20
    # what clients make the gateway store under cache_dir (S3 inputs downloaded, inputs converted):
    # least recently used evicted beyond it (`store.cache_budget`)
    max_cache_bytes: int = 64 << 30
    upstream_timeout: float = 600.0
    serve_timeout: float = 15.0     # wait this long for the engine's plugins to serve a cartridge
    # The S3 catalog the plugins sync (`storage_plugin.<name>.catalog_uri`): the gateway syncs it
    # into its own registry too, so gateways need no disk shared with the servers.
    catalog_uri: str | None = None
    catalog_period: float = 30.0
    catalog_allow_uris: tuple[str, ...] = ()  # entries' bytes outside the catalog's bucket: the plugin's setting
    # Clients must send `Authorization: Bearer <one of these>` on /v1/* (as vLLM's --api-key);
    # empty: no check (the loopback default; `gateway` warns when it binds elsewhere without keys).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    upstream_api_key: str | None = field(default=None, repr=False)  # sent to vLLM started with --api-key
    # Keys that belong to a tenant see only its cartridges (`Tenant`); `api_keys` see everything
    # the settings above allow (the operator's keys). A tenant's keys need not be in `api_keys`.
    tenants: tuple[Tenant, ...] = ()

    def tenant_of(self, key: str) -> "Tenant | None":
        """The tenant holding `key`, None for an operator key (checked by the caller)."""
        import hmac

        for t in self.tenants:
            if any(hmac.compare_digest(key.encode(), k.encode()) for k in t.keys):
                return t
        return None

    def all_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.api_keys, *(k for t in self.tenants for k in t.keys))))


API_KEY_ENV = API_KEYS.name  # comma-separated, like several --api-key


def gateway_api_keys(flags: list[str] | None = None) -> tuple[str, ...]:
    """The gateway's client keys: every `--api-key` flag, and those in $LMCACHE_CARTRIDGE_API_KEYS
    (the standalone gateway and the one inside vLLM read them so). ValueError for a short key."""
    import os

    keys = [k for k in (flags or [])] + os.environ.get(API_KEY_ENV, "").split(",")
    keys = list(dict.fromkeys(k.strip() for k in keys if k.strip()))
    if any(len(k) < 16 for k in keys):
        raise ValueError("an API key must have at least 16 characters")
    return tuple(keys)


def plugin_fields(config, plugin) -> dict:
    """GatewaySettings fields that are the server's: what its LMCache `config` and cartridge
    plugin settings (`PluginSettings`) say about the registry, cache dir, S3, chunk size, other
    model names and the catalog. One place, for the standalone gateway's `--config` and the
    gateway inside vLLM."""
    return dict(registry=plugin.registry, cache_dir=plugin.cache_dir, chunk_size=int(config.chunk_size),
                s3=dict(plugin.s3), accept_models=tuple(plugin.accept_models), catalog_uri=plugin.catalog_uri,
                catalog_period=float(plugin.catalog_period), catalog_allow_uris=tuple(plugin.catalog_allow_uris))


# The tenants file (`gateway --tenants`, the middleware's $LMCACHE_CARTRIDGE_TENANTS): its fields
# are these models' (docs/configuration.md shows them, generated), and this example is valid.
TENANTS_EXAMPLE = """\
tenants:
  - name: acme
    keys: [acme-key-0123456789abcdef]     # 16+ characters each
    ids: ["acme-*"]                       # registered ids (glob) it may name
    local: [/data/cartridges/acme]        # local roots (absolute)
    s3: [my-bucket/acme]                  # bucket or bucket/prefix
  - name: globex
    keys: [globex-key-0123456789abcdef, globex-key-2-0123456789]
    ids: ["globex-*", "shared-handbook"]
"""


class TenantEntry(BaseModel):
    """One tenant of the tenants file."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, description="the tenant's name, in errors and logs")
    keys: list[str] = Field(min_length=1, description="its clients' API keys (`Authorization: Bearer KEY`), 16+ "
                            "characters each, no key shared with another tenant")
    ids: list[str] = Field([], description="registered cartridge ids it may name, as globs (`acme-*`); a label "
                           "resolves only among these; any other id answers 404 as a missing one")
    local: list[str] = Field([], description="absolute directories its local cartridge paths must lie under "
                             "(as `--allow-local`, for this tenant alone)")
    s3: list[str] = Field([], description="`bucket` or `bucket/prefix` its `s3://` ids must lie under (as "
                          "`--allow-s3`, for this tenant alone)")

    @field_validator("keys")
    @classmethod
    def _long(cls, v):
        if any(len(k) < 16 for k in v):
            raise ValueError("every key must have at least 16 characters")
        return v

    @field_validator("local")
    @classmethod
    def _absolute(cls, v):
        if any(not Path(r).is_absolute() for r in v):
            raise ValueError("local roots must be absolute paths")
        return v


class TenantsFile(BaseModel):
    """The tenants file: one key, `tenants`, a list of `TenantEntry`."""

    model_config = ConfigDict(extra="forbid")
    tenants: list[TenantEntry]


def load_tenants(path: str | Path) -> tuple[Tenant, ...]:
    """Tenants from a YAML file (the gateway's `--tenants`), as in `TENANTS_EXAMPLE`. Validated
    whole (pydantic): unknown fields, a short key, a key two tenants share or a relative local
    root are errors that name the tenant, the field and the rule, never a value: the file holds
    keys, and the error reaches logs and (in vLLM's server) clients' 501 answers."""
    import yaml
    from pydantic import ValidationError

    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML{_yaml_where(e)}") from None
    try:
        parsed = TenantsFile.model_validate(raw)
    except ValidationError as e:
        raise ValueError(f"{path}: {_without_values(e, raw)}") from None
    seen: dict[str, str] = {}
    for t in parsed.tenants:
        for k in t.keys:
            if k in seen:
                raise ValueError(f"{path}: tenants {seen[k]!r} and {t.name!r} share a key")
            seen[k] = t.name
    return tuple(Tenant(t.name, tuple(t.keys), tuple(t.ids), tuple(Path(r) for r in t.local), tuple(t.s3))
                 for t in parsed.tenants)


def _yaml_where(e) -> str:
    """Where a YAML error is and what it is, without YAML's own text: that quotes the line, and a
    tenants file's lines hold keys."""
    def at(mark) -> str:
        return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    problem, context = getattr(e, "problem", None), getattr(e, "context", None)
    text = at(getattr(e, "problem_mark", None)) + (f": {problem}" if isinstance(problem, str) else "")
    if isinstance(context, str):
        text += f" ({context}{at(getattr(e, 'context_mark', None))})"
    return text


def _without_values(e, raw) -> str:
    """A pydantic error of the tenants file, each problem as where (the tenant's name, the field)
    and pydantic's rule, never the input it quotes (`str(e)` shows every key of a bad list)."""
    def where(loc) -> str:
        parts = []
        for i, p in enumerate(loc):
            if isinstance(p, int) and loc[:i] == ("tenants",):
                try:
                    name = raw["tenants"][p].get("name")
                except (AttributeError, IndexError, KeyError, TypeError):
                    name = None
                parts.append(f"tenant {name!r}" if isinstance(name, str) and len(name) <= 64 else f"tenant #{p + 1}")
            elif not (i == 0 and p == "tenants" and len(loc) > 1):
                parts.append(repr(p) if isinstance(p, str) else f"item #{p + 1}")
        return " ".join(parts) or "the file"

    problems = [f"{where(err['loc'])}: {err['msg']}" for err in e.errors(include_url=False, include_input=False)]
    return f"{len(problems)} problem{'s' if len(problems) > 1 else ''}: " + "; ".join(problems)
