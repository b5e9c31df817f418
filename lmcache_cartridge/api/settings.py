"""The gateway's settings and its client-error type. Runs in the gateway process; immutable."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class RequestError(Exception):
    """A client mistake: becomes an HTTP 4xx with this message."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after  # seconds, sent as Retry-After (429, 503)


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
