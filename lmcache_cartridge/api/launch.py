"""Starting the standalone gateway (`lmcache-cartridge gateway`): its settings from the command's
options and, given the server's LMCache config, the server's own (registry, cache dir, S3, chunk
size: read as the server reads them), a warning when it listens beyond loopback without API keys,
then uvicorn.

Runs in the gateway's process.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from lmcache_cartridge.api.settings import API_KEY_ENV, gateway_api_keys, load_tenants, plugin_fields
from lmcache_cartridge.paths import default_cache_dir, default_registry_path


def server_fields(args, config) -> dict:
    """The GatewaySettings fields that are the server's: from its LMCache `config` (loaded as the
    server loads it), else from the options that stand in for it (--registry, --chunk-size,
    --s3-endpoint)."""
    if config is not None:
        from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
        from lmcache_cartridge.lmcache.settings import PluginSettings

        return plugin_fields(config, PluginSettings.from_config(config, CartridgeStoragePlugin))
    return dict(registry=Path(args.registry or default_registry_path()), cache_dir=default_cache_dir(),
                chunk_size=args.chunk_size, s3={"endpoint_url": args.s3_endpoint} if args.s3_endpoint else {})


def gateway_settings(args, config=None):
    """The gateway's `GatewaySettings` from the `gateway` command's options and the server's
    LMCache `config` (None: the options alone)."""
    from lmcache_cartridge.api.gateway import GatewaySettings

    server = server_fields(args, config)
    return GatewaySettings(
        upstream=args.upstream.rstrip("/"),
        model=args.model,
        tokenizer=args.tokenizer or args.model,
        local_roots=tuple(Path(r) for r in (args.allow_local or [])),
        s3_roots=tuple(args.allow_s3 or ()),
        trained_chat_template=(args.trained_chat_template if args.trained_chat_template in (None, "model")
                               else Path(args.trained_chat_template).read_text()),
        max_cartridges=args.max_cartridges,
        max_body_bytes=args.max_body_bytes, max_cache_bytes=args.max_cache_bytes,
        serve_timeout=args.serve_timeout,
        force_redownload_interval=args.force_redownload_interval,
        **server,
        api_keys=gateway_api_keys(args.api_key),
        tenants=load_tenants(args.tenants) if args.tenants else (),
        upstream_api_key=args.upstream_api_key or os.environ.get("VLLM_API_KEY") or None,
    )


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(settings, host: str, port: int) -> None:
    """Serve the gateway until stopped. Open to other hosts without an API key it still serves (so
    a working setup keeps working), and says so on stderr and in the log."""
    import uvicorn

    from lmcache_cartridge.api.gateway import SERVER_KEEPALIVE_S, create_app

    if not settings.all_keys() and not is_loopback(host):
        print(f"WARNING: the gateway listens on {host}, reachable from other hosts, and checks no API key: "
              "anyone who can reach the port can use it and name every cartridge it may read. Set --api-key "
              f"(or ${API_KEY_ENV}).", file=sys.stderr, flush=True)
        logging.getLogger("lmcache_cartridge.gateway").warning("listening on %s without API keys", host)
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning", timeout_keep_alive=SERVER_KEEPALIVE_S)
