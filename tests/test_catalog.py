"""The S3 catalog: publish once, two hosts with their own registries converge; removal,
labels and force_redownload propagate on the next sync; a broken index keeps the last good state.

Real moto S3 on loopback behind the counting proxy (`s3_server.py`); two "hosts" are two cache
dirs with two SQLite registries, as on two machines (nothing shared but the bucket).
"""

import logging
import threading
import time

import pytest

from conftest import random_kv
from s3_server import s3_client
from lmcache_cartridge.cartridge.packed import pack_kv
from lmcache_cartridge.store.catalog import (CatalogError, CatalogSync, publish, read_catalog,
                                             unpublish)
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.store.s3 import S3Settings

BUCKET = "fleet"
CATALOG = f"s3://{BUCKET}/catalog/"
MODEL = "test/model"
CHUNK = 16


def _pack(root, cid, seed, labels=()):
    kv = random_kv(2, 2 * CHUNK, 2, 8, seed=seed)
    pack_kv(kv, root / f"{cid}-{seed}", cartridge_id=cid, model=MODEL, kind="first_k",
            token_ids=list(range(50 + seed, 50 + seed + 2 * CHUNK)), chunk_size=CHUNK, labels=list(labels))
    return root / f"{cid}-{seed}"


@pytest.fixture
def s3(moto_server, s3_proxy):
    client = s3_client(moto_server)
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    for o in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        client.delete_object(Bucket=BUCKET, Key=o["Key"])
    return S3Settings(endpoint_url=s3_proxy.endpoint_url, max_attempts=2), client


class Host:
    """One machine: its own registry and cache dir."""

    def __init__(self, root, settings, period=30.0):
        self.registry = Registry(root / "registry.db")
        self.sync = CatalogSync(self.registry, CATALOG, settings, period, cache_dir=root / "cache", chunk_size=CHUNK)

    def view(self):
        return {e.id: (e.source_uri, e.content_hash, tuple(e.labels), e.epoch) for e in self.registry.list()}


@pytest.fixture
def hosts(tmp_path, s3):
    settings, _ = s3
    hs = [Host(tmp_path / f"host{i}", settings) for i in (1, 2)]
    yield hs
    for h in hs:
        h.sync.stop()
        h.registry.close()


def test_two_hosts_converge_with_labels_and_the_published_bytes(tmp_path, s3, hosts):
    settings, client = s3
    a = _pack(tmp_path, "doc-a", 1, labels=["legal"])
    b = _pack(tmp_path, "doc-b", 2)
    publish(a, CATALOG, settings, labels=["v1"])
    publish(b, CATALOG, settings)
    for h in hosts:
        r = h.sync.sync_once()
        assert sorted(r.added) == ["doc-a", "doc-b"] and not r.errors and r.version == 2
    v1, v2 = hosts[0].view(), hosts[1].view()
    assert v1 == v2 and set(v1) == {"doc-a", "doc-b"}
    assert v1["doc-a"][2] == ("legal", "v1")
    # what each registry points at is byte-for-byte the packed payload
    entry = hosts[1].registry.get("doc-a")
    bucket_key = entry.source_uri[len("s3://"):].split("/", 1)
    remote = client.get_object(Bucket=bucket_key[0], Key=bucket_key[1] + "/kv.bin")["Body"].read()
    assert remote == (a / "kv.bin").read_bytes()
    # a second sync with nothing new does nothing
    assert hosts[0].sync.sync_once().added == []


@pytest.mark.heavy
def test_removal_labels_and_force_redownload_propagate_on_the_next_sync(tmp_path, s3, hosts, s3_proxy):
    settings, _ = s3
    a, b = _pack(tmp_path, "doc-a", 1), _pack(tmp_path, "doc-b", 2)
    publish(a, CATALOG, settings)
    publish(b, CATALOG, settings)
    for h in hosts:
        h.sync.sync_once()
    kv_puts = s3_proxy.count("PUT", r"kv\.bin")
    publish(a, CATALOG, settings, labels=["hot"], force_redownload=True)
    assert s3_proxy.count("PUT", r"kv\.bin") == kv_puts  # same bytes: nothing re-uploaded
    unpublish("doc-b", CATALOG, settings)
    for h in hosts:
        r = h.sync.sync_once()
        assert r.added == ["doc-a"] and r.removed == ["doc-b"]
        e = h.registry.get("doc-a")
        assert e.epoch == 1 and e.labels == ["hot"] and h.registry.get("doc-b") is None
    # a re-packed cartridge under the same id replaces the entry (new content hash, new prefix)
    a2 = _pack(tmp_path, "doc-a", 9)
    publish(a2, CATALOG, settings)
    hosts[0].sync.sync_once()
    assert hosts[0].registry.get("doc-a").source_uri.endswith("/" + read_catalog(CATALOG, settings)
                                                               .entries["doc-a"].content_hash)
    with pytest.raises(CatalogError, match="not in catalog"):
        unpublish("doc-b", CATALOG, settings)


def test_sync_thread_applies_a_removal_within_its_period(tmp_path, s3):
    settings, _ = s3
    h = Host(tmp_path / "h", settings, period=0.3)
    publish(_pack(tmp_path, "doc-a", 1), CATALOG, settings)
    h.sync.start()
    try:
        deadline = time.time() + 30  # generous: this proves propagation, not speed
        while h.registry.get("doc-a") is None and time.time() < deadline:
            time.sleep(0.05)
        assert h.registry.get("doc-a") is not None
        unpublish("doc-a", CATALOG, settings)
        while h.registry.get("doc-a") is not None and time.time() < deadline:
            time.sleep(0.05)
        assert h.registry.get("doc-a") is None
    finally:
        h.sync.stop()


def test_local_registrations_are_never_touched(tmp_path, s3, hosts):
    settings, _ = s3
    local = _pack(tmp_path, "doc-a", 3)
    hosts[0].registry.register(local)
    publish(_pack(tmp_path, "doc-a", 1), CATALOG, settings)
    r = hosts[0].sync.sync_once()
    assert r.added == [] and "doc-a" in r.errors
    assert hosts[0].registry.get("doc-a").source_uri == str(local.resolve())
    unpublish("doc-a", CATALOG, settings)
    hosts[0].sync.sync_once()
    assert hosts[0].registry.get("doc-a") is not None  # not ours to remove


@pytest.mark.heavy
def test_an_entry_is_its_manifests_id_and_stays_in_the_catalogs_bucket(tmp_path, s3, hosts, moto_server):
    """A catalog writer names ids, not other cartridges or buckets: an entry whose key is not its
    manifest's id (the old sync registered the manifest's id, replacing a local registration,
    and never cleaned it up) and an entry pointing into another bucket are refused; good entries
    in the same index still sync. `catalog_allow_uris` lets the operator allow another bucket."""
    from lmcache_cartridge.store.catalog import _Catalog

    settings, client = s3
    local = _pack(tmp_path, "doc-a", 3)
    hosts[0].registry.register(local)
    publish(_pack(tmp_path, "doc-b", 1), CATALOG, settings)
    b_uri = read_catalog(CATALOG, settings).entries["doc-b"].uri
    try:
        client.create_bucket(Bucket="elsewhere")
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    other = b_uri.replace(f"s3://{BUCKET}/", "s3://elsewhere/")
    for o in client.list_objects_v2(Bucket=BUCKET, Prefix=b_uri.split("/", 3)[3]).get("Contents", []):
        client.copy_object(Bucket="elsewhere", Key=o["Key"], CopySource={"Bucket": BUCKET, "Key": o["Key"]})
    # doc-a's manifest bytes published under the key "x"; doc-b's bytes in another bucket as "doc-b2"
    publish(_pack(tmp_path, "doc-a", 4), CATALOG, settings)
    a_entry = read_catalog(CATALOG, settings).entries["doc-a"]
    cat = _Catalog(CATALOG, settings)

    def forge(index):
        index.entries["x"] = a_entry.model_copy()
        index.entries["far"] = index.entries["doc-b"].model_copy(update={"uri": other})
        del index.entries["doc-a"]

    cat.commit(forge)
    r = hosts[0].sync.sync_once()
    assert r.added == ["doc-b"], r
    assert "names cartridge 'doc-a', not 'x'" in r.errors["x"] and "outside the catalog's bucket" in r.errors["far"]
    assert hosts[0].registry.get("doc-a").source_uri == str(local.resolve())  # untouched
    assert {e.id for e in hosts[0].registry.list()} == {"doc-a", "doc-b"}
    allowed = CatalogSync(Registry(tmp_path / "h3.db"), CATALOG, settings, cache_dir=tmp_path / "h3",
                          chunk_size=CHUNK, allow_uris=("s3://elsewhere/",))
    r = allowed.sync_once()
    assert "names cartridge 'doc-b', not 'far'" in r.errors["far"]  # the bucket is allowed now; the id still is not


def test_corrupt_or_missing_index_keeps_the_last_good_state(tmp_path, s3, hosts, caplog):
    settings, client = s3
    publish(_pack(tmp_path, "doc-a", 1), CATALOG, settings)
    h = hosts[0]
    h.sync.sync_once()
    before = h.view()
    client.put_object(Bucket=BUCKET, Key="catalog/index/v000000000002.json", Body=b'{"format": "lmcache-cart')
    with caplog.at_level(logging.ERROR, logger="lmcache_cartridge.catalog"):
        r = h.sync.sync_once()
        h.sync.sync_once()
    assert "index" in r.errors and h.view() == before and h.sync.last_good_version == 1
    lines = [m for m in caplog.messages if "v000000000002.json is corrupt" in m]
    assert len(lines) == 1 and "keeping the last good state (version 1)" in lines[0]
    for o in client.list_objects_v2(Bucket=BUCKET, Prefix="catalog/").get("Contents", []):
        if "/index/" in o["Key"] or o["Key"].endswith("CURRENT"):
            client.delete_object(Bucket=BUCKET, Key=o["Key"])
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="lmcache_cartridge.catalog"):
        r = h.sync.sync_once()
    assert "no catalog index" in r.errors["index"] and h.view() == before
    assert any("no catalog index" in m for m in caplog.messages)


@pytest.mark.heavy
def test_concurrent_publishers_lose_no_update(tmp_path, s3, s3_proxy):
    settings, _ = s3
    dirs = [[_pack(tmp_path, f"p{w}-c{i}", 10 * w + i) for i in range(3)] for w in range(2)]
    publish(dirs[0][0], CATALOG, settings)  # the catalog exists before the race
    barrier = threading.Barrier(2)
    failures = []

    def worker(w):
        barrier.wait()
        for d in dirs[w][(1 if w == 0 else 0):]:
            try:
                publish(d, CATALOG, settings)
            except Exception as e:  # pragma: no cover - reported below
                failures.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures
    index = read_catalog(CATALOG, settings)
    assert sorted(index.entries) == sorted(f"p{w}-c{i}" for w in range(2) for i in range(3))
    assert index.version == 6  # one version per publish: none overwritten, none lost
    # every version is there exactly once, a line
    assert s3_proxy.count("PUT", r"/index/v\d+\.json", status=200) == 6


def test_publish_refuses_a_cartridge_that_fails_verification(tmp_path, s3):
    settings, _ = s3
    d = _pack(tmp_path, "doc-a", 1)
    raw = bytearray((d / "kv.bin").read_bytes())
    raw[5] ^= 0xFF
    (d / "kv.bin").write_bytes(bytes(raw))
    with pytest.raises(CatalogError, match="fails verification"):
        publish(d, CATALOG, settings)
    assert read_catalog(CATALOG, settings) is None


@pytest.mark.heavy
def test_publish_and_unpublish_from_the_command_line(tmp_path, s3, hosts):
    """What an operator types: `lmcache-cartridge publish DIR CATALOG`, then `unpublish ID CATALOG`;
    a host's sync follows both."""
    from test_cli import cli

    settings, _ = s3
    a = _pack(tmp_path, "doc-cli", 3)
    r = cli("publish", a, CATALOG, "--label", "ops", "--s3-endpoint", settings.endpoint_url, home=tmp_path / "home")
    assert "published " in r.stdout and "/doc-cli/" in r.stdout
    hosts[0].sync.sync_once()
    assert hosts[0].view()["doc-cli"][2] == ("ops",)
    r = cli("unpublish", "doc-cli", CATALOG, "--s3-endpoint", settings.endpoint_url, home=tmp_path / "home")
    assert "removed doc-cli" in r.stdout
    hosts[0].sync.sync_once()
    assert "doc-cli" not in hosts[0].view()
    r = cli(
        "unpublish", "doc-cli", CATALOG, "--s3-endpoint", settings.endpoint_url, home=tmp_path / "home", check=False
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not in catalog" in r.stderr
