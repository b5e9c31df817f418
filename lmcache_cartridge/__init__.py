"""lmcache_cartridge: serve KV cache cartridges to vLLM through LMCache's storage-plugin path."""

__version__ = "0.1.0"


def ensure_log_handler() -> None:
    """Give the package's loggers a handler where the host process configured none: vLLM
    configures only its own loggers, so without one our INFO lines (plugin ready, layout verified,
    the middleware's start line) would be dropped. Called by the vLLM connector at import and by
    the middleware at server start; a host that configured logging keeps its own."""
    import logging

    pkg = logging.getLogger("lmcache_cartridge")
    if not pkg.handlers and not logging.getLogger().handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[%(asctime)s] %(name)s %(levelname)s: %(message)s"))
        pkg.addHandler(h)
        if pkg.level == logging.NOTSET:
            pkg.setLevel(logging.INFO)
