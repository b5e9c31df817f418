"""`lmcache-cartridge register s3://...`: what the URI holds decides how it is registered. A packed
cartridge's prefix (or a `.pt` object) goes through `registration.register_s3`: its manifest is
fetched and checked, its chunks stay in S3 until a server reads them. A prefix holding a maker's
input directory (PEFT CARTRIDGE adapter, Tokasaurus directory, ...) is downloaded and converted
once, as the gateway does (`registration.fetch_s3_dir` + `convert_input`), and the packed result
is registered.

Runs in the CLI's process, on an operator's machine or next to a server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from lmcache_cartridge.errors import CartridgeError


def register_s3_uri(uri: str, open_registry: Callable, s3_settings, cache_dir: Path, *, model_dir: str | None,
                    model: str | None, chunk_size: int | None, convert_chunk_size: int, labels: list[str],
                    force_redownload: bool) -> str:
    """Register `uri` and return the line the command prints. `open_registry()` is called only once
    the input is known to be registrable, so a mistake leaves no registry behind. `chunk_size`: the
    serving chunk size a packed cartridge is checked against (None: not checked);
    `convert_chunk_size`: the one an input directory is packed with."""
    from lmcache_cartridge.cartridge.compat import EngineShape
    from lmcache_cartridge.store.registration import register_s3

    if not uri.endswith(".pt"):
        converted = _register_input_dir(uri, open_registry, s3_settings, cache_dir, model_dir=model_dir,
                                        model=model, chunk_size=convert_chunk_size, labels=labels,
                                        force_redownload=force_redownload)
        if converted is not None:
            return converted
    entry = register_s3(open_registry(), uri, cache_dir, s3_settings, labels=labels,
                        force_redownload=force_redownload, engine=EngineShape.partial(chunk_size=chunk_size))
    return (f"registered {entry.id} ({entry.kind}, {entry.num_tokens} tokens, model {entry.model}) "
            f"from {entry.source_uri}{' (servers will download it again)' if force_redownload else ''}")


def _register_input_dir(uri: str, open_registry: Callable, s3_settings, cache_dir: Path, *, model_dir: str | None,
                        model: str | None, chunk_size: int, labels: list[str], force_redownload: bool) -> str | None:
    """An input directory under `uri`, converted and registered (the printed line). None when the
    prefix holds a packed cartridge, or nothing: the caller registers it as an S3 origin, or says
    which manifest is missing."""
    from lmcache_cartridge.store.registration import convert_input, fetch_s3_dir, load_vocab
    from lmcache_cartridge.store.s3 import NotFound

    try:
        listed = fetch_s3_dir(uri, s3_settings, cache_dir, force=force_redownload)
    except NotFound:  # nothing at the prefix: the packed-cartridge path names the manifest it wanted
        return None
    if listed.packed:
        return None
    if not model_dir:
        raise CartridgeError(f"{uri} is an input directory, not a packed cartridge: it is converted on "
                             "registration, which needs the serving model: pass --model-dir DIR (its vocabulary "
                             "and dtype; --model NAME if vLLM serves it under another name)")
    out = convert_input(listed.path, listed.digest, cache_dir, model=model or model_dir, chunk_size=chunk_size,
                        vocab=lambda: load_vocab(model_dir), name=listed.uri.rsplit("/", 1)[-1],
                        model_dir=model_dir)
    if out.packed_dir is None:
        raise CartridgeError(f"{uri} holds token ids only: there is no KV to register "
                             "(send it in a request's cartridges; vLLM computes and caches it)")
    entry = open_registry().register(out.packed_dir, labels=labels, force_redownload=force_redownload)
    return (f"registered {entry.id} ({entry.kind}, {entry.num_tokens} tokens, model {entry.model}) "
            f"from {uri} (converted: {listed.downloaded} files downloaded -> {entry.path})")
