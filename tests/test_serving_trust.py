"""What a manifest's writer or a catalog's writer can make the serving side (the in-process
plugin inside a real LMCache engine, the MP adapter, the tiers) serve: each test is a bypass a
review reproduced, and fails on the code before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import random_kv
from lmcache_cartridge.cartridge.keys import SALT_TAG
from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, PAYLOAD_NAME
from lmcache_cartridge.cartridge.packed import pack_kv
from lmcache_cartridge.store.registry import Registry
from test_plugin import CHUNK, D, H, L, MODEL, engine_for, flat


def copy_digests(forger: Path, victim: Path) -> None:
    """The review's forgery: the forger's manifest keeps its own id and token ids but lists the
    victim's chunks (their digests), so its derived content hash is the victim's; its payload is
    zeros of the same size (it needs none of the victim's bytes)."""
    mine = json.loads((forger / MANIFEST_NAME).read_text())
    theirs = json.loads((victim / MANIFEST_NAME).read_text())
    mine.update(chunks=theirs["chunks"], content_hash=theirs["content_hash"])
    (forger / MANIFEST_NAME).write_text(json.dumps(mine))
    (forger / PAYLOAD_NAME).write_bytes(bytes((victim / PAYLOAD_NAME).stat().st_size))


def test_copied_chunk_digests_never_read_another_cartridges_cached_bytes(tmp_path):
    """Chunk tiers were keyed by content hash, which a manifest derives from digests anyone may
    copy: once the victim had been read, the forged cartridge (its own id, the victim's digests,
    a payload of zeros) was served the victim's bytes from the CPU tier, and its own payload was
    never read. A cartridge is now served only bytes verified against its own origin: the forged
    one's zeros fail verification, and nothing of the victim reaches its requests."""
    from lmcache_cartridge.store.origins import load_registered

    reg = Registry(tmp_path / "reg.db")
    victim_ids, forged_ids = list(range(10, 10 + 2 * CHUNK)), list(range(3000, 3000 + 2 * CHUNK))
    kv = random_kv(L, 2 * CHUNK, H, D, seed=1)
    pack_kv(kv, tmp_path / "victim", cartridge_id="victim", model=MODEL, kind="first_k", token_ids=victim_ids,
            chunk_size=CHUNK)
    pack_kv(random_kv(L, 2 * CHUNK, H, D, seed=2), tmp_path / "forger", cartridge_id="forger", model=MODEL,
            kind="first_k", token_ids=forged_ids, chunk_size=CHUNK)
    copy_digests(tmp_path / "forger", tmp_path / "victim")
    reg.register(tmp_path / "victim")
    forged = reg.register(tmp_path / "forger", client=True)  # a client's: keyed under its salt
    assert forged.content_hash == reg.get("victim").content_hash and forged.salt
    assert load_registered(forged).token_ids == forged_ids  # it loads: its manifest is consistent
    tagged = {SALT_TAG: forged.salt}
    with engine_for(tmp_path, reg.path) as eng:
        n, got = eng.retrieve(victim_ids + [1])
        assert n == 2 * CHUNK and torch.equal(got[:, :, :n], flat(kv))  # the victim, read once
        eng.clear_local_cpu()
        n, got = eng.retrieve(forged_ids + [1], request_configs=tagged)
        assert not torch.equal(got[:, :, :2 * CHUNK], flat(kv)), "the victim's bytes were served"
        assert n == 0, n  # its own payload does not hold what its manifest says
        eng.clear_local_cpu()
        n, got = eng.retrieve(victim_ids + [1])
        assert n == 2 * CHUNK and torch.equal(got[:, :, :n], flat(kv))  # the victim is still served


def test_copied_chunk_digests_never_read_another_origins_disk_cache(tmp_path, moto_server, s3_proxy):
    """The same forgery on S3: the victim's chunks, downloaded into the host's disk cache, were
    read for the forged prefix too (its manifest's digests match them). Another origin's disk
    copies are not local to it: it reads, and fails, its own."""
    from lmcache_cartridge.cartridge.packed import PackedCartridge
    from lmcache_cartridge.errors import ChecksumError
    from lmcache_cartridge.store.metrics import Metrics
    from lmcache_cartridge.store.origins import S3ChunkOrigin
    from lmcache_cartridge.store.residency import DiskTier, Handle, MemoryTier, NotLocal, Residency
    from lmcache_cartridge.store.s3 import S3Settings
    from s3_server import s3_client, upload_dir

    kv = random_kv(L, 2 * CHUNK, H, D, seed=3)
    pack_kv(kv, tmp_path / "victim", cartridge_id="victim", model=MODEL, kind="first_k",
            token_ids=list(range(10, 10 + 2 * CHUNK)), chunk_size=CHUNK)
    pack_kv(random_kv(L, 2 * CHUNK, H, D, seed=4), tmp_path / "forger", cartridge_id="forger", model=MODEL,
            kind="first_k", token_ids=list(range(3000, 3000 + 2 * CHUNK)), chunk_size=CHUNK)
    copy_digests(tmp_path / "forger", tmp_path / "victim")
    c = s3_client(moto_server)
    for name in ("victim", "forger"):
        upload_dir(c, "trust-carts", name, tmp_path / name)
    settings = S3Settings(endpoint_url=s3_proxy.endpoint_url, max_attempts=1)
    victim, forged = (Handle(PackedCartridge(tmp_path / n).manifest, S3ChunkOrigin(f"s3://trust-carts/{n}", settings))
                      for n in ("victim", "forger"))
    assert victim.content_hash == forged.content_hash
    res = Residency(MemoryTier("cpu", 0), DiskTier(tmp_path / "cache", 1 << 30), Metrics(), prefetch=False)
    try:
        assert res._download(victim) == 2 and res.resident(victim)
        out = torch.empty(victim.view.engine_nbytes(0), dtype=torch.uint8)
        assert not res.is_local(forged, 0) and not res.resident(forged)
        with pytest.raises(NotLocal):
            res.read_into(forged, 0, out, network=False)
        with pytest.raises(ChecksumError):
            res.read_into(forged, 0, out, network=True)
        assert res.read_into(victim, 0, out, network=False) == "disk"
    finally:
        res.close()
        victim.origin.close()
        forged.origin.close()


# --- whose chunk keys: the operator's registrations over a catalog's, ambiguity refused ------------
CATALOG = "s3://trust-catalog/catalog"
PROMPT, PROMPT2 = list(range(70, 70 + 2 * CHUNK)), list(range(900, 900 + 2 * CHUNK))


@pytest.fixture
def claimed(tmp_path, moto_server, s3_proxy):
    """The operator's first-k `handbook` (local) for PROMPT, and a catalog (moto) whose writer
    published unsalted first-k entries of other KV for the same ids (`zz-evil`, `zz-evil-2`: ids
    sorting after `handbook`) and two of different KV for PROMPT2 (`cat-a`, `cat-b`), synced into
    the host's registry as the plugin's syncer does."""
    from lmcache_cartridge.store.catalog import CatalogSync, publish
    from lmcache_cartridge.store.s3 import S3Settings
    from s3_server import s3_client

    s3_client(moto_server).create_bucket(Bucket="trust-catalog")
    settings = S3Settings(endpoint_url=s3_proxy.endpoint_url)
    kv = {name: random_kv(L, 2 * CHUNK, H, D, seed=40 + n)
          for n, name in enumerate(("handbook", "zz-evil", "zz-evil-2", "cat-a", "cat-b"))}
    for name, tokens in (("handbook", PROMPT), ("zz-evil", PROMPT), ("zz-evil-2", PROMPT), ("cat-a", PROMPT2),
                         ("cat-b", PROMPT2)):
        pack_kv(kv[name], tmp_path / "src" / name, cartridge_id=name, model=MODEL, kind="first_k",
                token_ids=tokens, chunk_size=CHUNK)
        if name != "handbook":
            publish(tmp_path / "src" / name, CATALOG, settings)
    reg = Registry(tmp_path / "reg.db")
    reg.register(tmp_path / "src" / "handbook")
    report = CatalogSync(reg, CATALOG, settings, cache_dir=tmp_path / "cache", chunk_size=CHUNK).sync_once()
    assert sorted(report.added) == ["cat-a", "cat-b", "zz-evil", "zz-evil-2"], report
    assert not any(reg.get(i).salt for i in report.added)  # a catalog's first-k is unsalted
    return {"reg": reg, "kv": kv, "dir": tmp_path, "endpoint": s3_proxy.endpoint_url}


def _wait(pred, timeout=30.0):
    import time

    deadline = time.time() + timeout
    while not pred() and time.time() < deadline:
        time.sleep(0.05)
    return pred()


def test_a_catalog_entry_never_serves_the_operators_keys_in_process(claimed):
    """The plugin indexed every entry's chunk keys in id order, the last one winning: a catalog
    entry with the operator's cartridge's token ids (unsalted: a catalog's first-k is) served
    its own KV for them. The operator's registration takes precedence now and the catalog's
    claim is refused with the reason; two catalog entries claiming the same keys with different
    KV are ambiguous: neither is served."""
    kv = claimed["kv"]
    with _engine(claimed) as eng:
        plugin = eng.backend("cartridge")
        assert _wait(lambda: eng.engine.lookup(PROMPT + [1]) == 2 * CHUNK)
        eng.clear_local_cpu()
        n, got = eng.retrieve(PROMPT + [1])
        assert n == 2 * CHUNK and torch.equal(got[:, :, :n], flat(kv["handbook"]))
        skipped = plugin._state.skipped
        for name in ("zz-evil", "zz-evil-2"):
            assert "handbook" in skipped.get(name, ""), skipped
        for name in ("cat-a", "cat-b"):
            assert "ambiguous" in skipped.get(name, ""), skipped
        assert eng.engine.lookup(PROMPT2 + [1]) == 0
        assert set(plugin.served_now()) == {"handbook"}


def _engine(claimed):
    import yaml

    from lmc_helpers import Engine, make_metadata
    from test_plugin import load_config, write_yaml

    path = write_yaml(claimed["dir"], claimed["reg"].path)
    cfg = yaml.safe_load(path.read_text())
    cfg["extra_config"]["storage_plugin.cartridge.s3.endpoint_url"] = claimed["endpoint"]
    path.write_text(yaml.safe_dump(cfg))
    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
    return Engine(load_config(path), md)


def test_a_catalog_entry_never_serves_the_operators_keys_in_mp_mode(claimed):
    """The same claims in the MP adapter (its index was built the same way)."""
    import time
    from types import SimpleNamespace

    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    from lmcache_cartridge.lmcache.mp_adapter import CartridgeL2Adapter
    from test_mp_adapter import _wait as wait_task

    adapter = CartridgeL2Adapter({"registry": str(claimed["reg"].path), "cache_dir": str(claimed["dir"] / "cache"),
                                  "refresh_seconds": 60, "s3.endpoint_url": claimed["endpoint"]})
    try:
        hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        rank = ObjectKey.ComputeKVRank(1, 0, 1, 0)
        keys = [ObjectKey(h, MODEL, rank, 0, "") for h in hasher.compute_chunk_hashes(PROMPT)]
        objs = [SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H * D, dtype=torch.bfloat16)) for _ in keys]
        assert wait_task(adapter, "load", adapter.submit_load_task(keys, objs)).popcount() == 2
        for i, obj in enumerate(objs):
            assert torch.equal(obj.tensor, flat(claimed["kv"]["handbook"])[:, :, i * CHUNK:(i + 1) * CHUNK])
        status = adapter.report_status()
        assert status["cartridges"] == 1, status
        for name, why in (("zz-evil", "handbook"), ("zz-evil-2", "handbook"), ("cat-a", "ambiguous"),
                          ("cat-b", "ambiguous")):
            assert why in status["not_served"].get(name, ""), status
        keys2 = [ObjectKey(h, MODEL, rank, 0, "") for h in hasher.compute_chunk_hashes(PROMPT2)]
        time.sleep(0.2)
        assert wait_task(adapter, "load", adapter.submit_load_task(keys2, objs)).popcount() == 0
    finally:
        adapter.close()


def test_mp_accept_models_maps_names_of_one_model_not_every_cartridge(tmp_path):
    """`accept_models` names the same weights under other names. The MP adapter added them to
    every cartridge's models: with `accept_models: [model-a]` a model-b cartridge's KV was loaded
    for model-a's keys. A cartridge serves its own model's keys, and the other names listed
    with its model, nothing else."""
    from types import SimpleNamespace

    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    from lmcache_cartridge.lmcache.mp_adapter import CartridgeL2Adapter
    from test_mp_adapter import _wait as wait_task

    reg = Registry(tmp_path / "reg.db")
    ids = {"model-a": list(range(100, 100 + CHUNK)), "model-b": list(range(500, 500 + CHUNK))}
    kv = {m: random_kv(L, CHUNK, H, D, seed=60 + n) for n, m in enumerate(ids)}
    for model in ids:
        pack_kv(kv[model], tmp_path / model, cartridge_id=f"doc-{model}", model=model, kind="first_k",
                token_ids=ids[model], chunk_size=CHUNK)
        reg.register(tmp_path / model)
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 60, "accept_models": "model-a,alias-a"})
    try:
        hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        rank = ObjectKey.ComputeKVRank(1, 0, 1, 0)

        def load(cart_model, key_model):
            (h,) = hasher.compute_chunk_hashes(ids[cart_model])
            obj = SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H * D, dtype=torch.bfloat16))
            got = wait_task(adapter, "load", adapter.submit_load_task([ObjectKey(h, key_model, rank, 0, "")], [obj]))
            assert not got.popcount() or torch.equal(obj.tensor, flat(kv[cart_model]))
            return got.popcount()

        assert [load("model-b", m) for m in ("model-b", "model-a", "alias-a")] == [1, 0, 0]
        assert [load("model-a", m) for m in ("model-a", "alias-a", "model-b")] == [1, 1, 0]
    finally:
        adapter.close()


def test_entries_a_catalog_synced_before_it_was_recorded_are_claimed_for_it_again(claimed):
    """A registry written before entries recorded their catalog holds a catalog's entries as if
    the operator had registered them (the most trusted claims). The next sync records them as
    the catalog's (one manifest GET each), so their claims yield to the operator's."""
    import sqlite3

    from lmcache_cartridge.store.catalog import CatalogSync
    from lmcache_cartridge.store.s3 import S3Settings

    reg = claimed["reg"]
    assert reg.get("zz-evil").catalog == CATALOG
    with sqlite3.connect(reg.path) as db:  # as the version before wrote it
        db.execute("UPDATE cartridges SET catalog = ''")
    assert reg.get("zz-evil").rank == 0
    with _engine(claimed) as eng:  # serving already: all four claims look like the operator's
        plugin = eng.backend("cartridge")
        assert "zz-evil-2" in plugin.served_now()
        sync = CatalogSync(reg, CATALOG, S3Settings(endpoint_url=claimed["endpoint"]),
                           cache_dir=claimed["dir"] / "cache", chunk_size=CHUNK)
        report = sync.sync_once()
        assert sorted(report.added) == ["cat-a", "cat-b", "zz-evil", "zz-evil-2"], report
        assert reg.get("zz-evil").catalog == CATALOG and reg.get("handbook").catalog == ""
        assert sync.sync_once().added == []  # once
        plugin.refresh()  # the registry changed: the serving process sees whose entries they are
        assert set(plugin.served_now()) == {"handbook"}
        eng.clear_local_cpu()
        n, got = eng.retrieve(PROMPT + [1])
        assert n == 2 * CHUNK and torch.equal(got[:, :, :n], flat(claimed["kv"]["handbook"]))


def test_a_client_naming_a_catalog_entry_never_lifts_it_to_the_operators_precedence(claimed):
    """A catalog entry copying the operator's token ids with its own KV ranks below the
    operator's. A client naming the entry's S3 URI (inside an `--allow-s3` root) re-registered
    it as "vouched" (any non-client entry of that origin counted), with no catalog marker: rank
    0, and its id sorting after `handbook` made it serve the operator's prompt. The entry stays
    the catalog's, however a client names it (force_redownload included), and the operator's
    KV is served."""
    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.api.requests import CartridgeSpec
    from lmcache_cartridge.api.resolver import Resolver
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    reg = claimed["reg"]
    uri = reg.get("zz-evil").source_uri
    settings = GatewaySettings(upstream="http://127.0.0.1:9", model=MODEL, tokenizer=str(ensure_test_model()),
                               registry=reg.path, cache_dir=claimed["dir"] / "cache", chunk_size=CHUNK,
                               s3_roots=("trust-catalog",), s3={"endpoint_url": claimed["endpoint"]},
                               force_redownload_interval=0.001)
    r = Resolver(settings, reg)
    for force in (False, True):
        got = r.resolve(CartridgeSpec(id=uri, force_redownload=force))
        assert got.entry.id == "zz-evil" and not got.entry.salt
        assert (reg.get("zz-evil").catalog, reg.get("zz-evil").rank) == (CATALOG, 1)
    with _engine(claimed) as eng:
        plugin = eng.backend("cartridge")
        assert "handbook" in plugin._state.skipped.get("zz-evil", ""), plugin._state.skipped
        eng.clear_local_cpu()
        n, got = eng.retrieve(PROMPT + [1])
        assert n == 2 * CHUNK and torch.equal(got[:, :, :n], flat(claimed["kv"]["handbook"]))


def test_among_the_operators_own_claims_the_first_registered_serves_not_the_id_sorting_last(tmp_path):
    """Two of the operator's registrations claiming the same keys with different KV: the one
    registered first keeps serving them (a re-registration of its origin keeps its place); a
    later one, even with an id sorting after it, does not take them over."""
    reg = Registry(tmp_path / "reg.db")
    kv = {name: random_kv(L, 2 * CHUNK, H, D, seed=80 + n) for n, name in enumerate(("handbook", "zz-later"))}
    for name in kv:
        pack_kv(kv[name], tmp_path / name, cartridge_id=name, model=MODEL, kind="first_k", token_ids=PROMPT,
                chunk_size=CHUNK)
    first = reg.register(tmp_path / "handbook")
    reg.register(tmp_path / "zz-later")
    assert reg.register(tmp_path / "handbook", force_redownload=True).added_at == first.added_at
    with engine_for(tmp_path, reg.path) as eng:
        n, got = eng.retrieve(PROMPT + [1])
        assert n == 2 * CHUNK and torch.equal(got[:, :, :n], flat(kv["handbook"]))


def test_a_catalogs_label_never_squats_the_operators(tmp_path):
    """A catalog entry labelled `demo` made the operator's `demo` answer "names 2 cartridges"
    (and MP `preload: [demo]` warmed the catalog's entry too). A label names the most trusted
    entries carrying it: the operator's `demo` stays the operator's; a catalog's own label still
    names it where the operator gave that label to none."""
    from types import SimpleNamespace

    from lmcache_cartridge.lmcache.serving_set import ServingSet

    reg = Registry(tmp_path / "reg.db")
    for name, seed in (("handbook", 1), ("cat-demo", 2)):
        pack_kv(random_kv(L, CHUNK, H, D, seed=seed), tmp_path / name, cartridge_id=name, model=MODEL,
                kind="first_k", token_ids=list(range(seed * 100, seed * 100 + CHUNK)), chunk_size=CHUNK)
    reg.register(tmp_path / "handbook", labels=["demo"])
    reg.register(tmp_path / "cat-demo", labels=["demo", "catalog-only"], catalog=CATALOG)
    assert reg.resolve("demo").id == "handbook"
    assert reg.resolve("catalog-only").id == "cat-demo"
    preload = ServingSet._names
    assert preload("demo", SimpleNamespace(entry=reg.get("handbook")))
    assert not preload("demo", SimpleNamespace(entry=reg.get("cat-demo")))
    assert preload("cat-demo", SimpleNamespace(entry=reg.get("cat-demo")))
