"""The MP-mode L2 adapter's pieces that need no server: its settings (the plugin's, by name, a typo
refused at server start), `mp-server`'s command line from the same YAML, the kv_rank packing it
decodes (LMCache's own `ComputeKVRank`), and a tensor-parallel key served only its rank's heads.
The server itself is exercised in `tests/test_mp_e2e.py`.
"""

from __future__ import annotations

import json
import shlex
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.multiprocess.token_hasher import TokenHasher

from conftest import random_kv
from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.cartridge.packed import pack_kv
from lmcache_cartridge.lmcache.mp_adapter import CartridgeL2Adapter, CartridgeL2AdapterConfig, kv_world_and_rank
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.store.serving_state import read_states

CHUNK = 64
MODEL = "tiny-mp-model"


def test_adapter_params_are_the_plugin_settings_and_a_typo_is_refused(tmp_path):
    cfg = CartridgeL2AdapterConfig.from_dict({"registry": str(tmp_path / "r.db"), "cache_dir": str(tmp_path / "c"),
                                              "accept_models": "a,b", "s3.region": "eu-west-1"})
    assert cfg.settings.registry == tmp_path / "r.db" and cfg.settings.accept_models == ("a", "b")
    assert cfg.settings.s3 == {"region": "eu-west-1"}
    with pytest.raises(ValueError, match="did you mean 'adapter_params.registry'"):
        CartridgeL2AdapterConfig.from_dict({"registy": "x"})


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_kv_rank_decoding_is_lmcaches_packing(world):
    from lmcache.v1.distributed.api import ObjectKey as OK

    compute = OK.ComputeKVRank
    for rank in range(world):
        # local world and rank differ from the global ones (two nodes): the global ones are decoded
        assert kv_world_and_rank(compute(world, rank, max(1, world // 2), rank % max(1, world // 2))) == (world, rank)


def test_mp_server_command_reads_the_plugin_yaml(tmp_path, capsys):
    from lmcache_cartridge.tools.cli import main

    yaml_path = tmp_path / "lmc.yaml"
    yaml_path.write_text(
        "chunk_size: 128\nlocal_cpu: true\nmax_local_cpu_size: 1\nstorage_plugins: [\"cartridge\"]\n"
        "pre_caching_hash_algorithm: sha256_cbor\nextra_config:\n"
        "  storage_plugin.cartridge.module_path: lmcache_cartridge.plugin\n"
        "  storage_plugin.cartridge.class_name: CartridgeStoragePlugin\n"
        f"  storage_plugin.cartridge.registry: {tmp_path / 'reg.db'}\n"
        "  storage_plugin.cartridge.accept_models: other-name\n")
    assert main(["mp-server", "--config", str(yaml_path), "--port", "5601", "--print"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[:2] == ["lmcache", "server"] and argv[argv.index("--port") + 1] == "5601"
    assert argv[argv.index("--chunk-size") + 1] == "128"
    adapter = json.loads(argv[argv.index("--l2-adapter") + 1])
    params = CartridgeL2AdapterConfig.from_dict(adapter["adapter_params"]).settings  # what the server will build
    assert params.registry == tmp_path / "reg.db" and params.accept_models == ("other-name",)
    assert adapter["module_path"] == "lmcache_cartridge.lmcache.mp_adapter"
    assert json.loads(argv[argv.index("--server-module") + 1]) == {"module_path": "lmcache_cartridge.vllm.mp_server"}
    # L1 in shared memory, named by the port (LMCache unlinks a segment of that name at start: one
    # server per port, never another's); engine-driven workers copy from it instead of unpickling
    assert argv[argv.index("--shm-name") + 1] == "lmcache_l1_pool_cartridge_5601"
    # a repeat of a hot cartridge hits L1, as in-process LMCache keeps a plugin hit in its CPU backend
    assert argv[argv.index("--l2-prefetch-policy") + 1] == "retain"

    assert main(["mp-server", "--config", str(yaml_path), "--port", "5601", "--no-shm", "--prefetch-policy",
                 "default", "--print"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert "--shm-name" not in argv and argv[argv.index("--l2-prefetch-policy") + 1] == "default"


def _wait(adapter, kind: str, tid: int):
    deadline = time.time() + 30
    while time.time() < deadline:
        got = getattr(adapter, {"lookup": "query_lookup_and_lock_result", "load": "query_load_result"}[kind])(tid)
        if got is not None:
            return got
        time.sleep(0.01)
    raise TimeoutError(kind)


def test_a_tensor_parallel_key_is_served_its_ranks_heads(tmp_path):
    """Keys carry world size and rank (`kv_rank`); the adapter fills each rank's object with that
    rank's heads of the chunk (a KV_2LTD object, as a GPU engine's), and hits only keys of the
    cartridge's model, without a salt."""
    L, H, D = 2, 4, 16
    kv = random_kv(L, 2 * CHUNK, H, D, seed=5)
    ids = list(range(100, 100 + 2 * CHUNK))
    pack_kv(kv, tmp_path / "doc", cartridge_id="doc", model=MODEL, kind="first_k", token_ids=ids, chunk_size=CHUNK)
    reg = Registry(tmp_path / "reg.db")
    reg.register(tmp_path / "doc")
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 60})
    try:
        hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
        # the server's context as the adapter reads it: its hasher and chunk size (no L1 to purge)
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        hashes = hasher.compute_chunk_hashes(ids)
        world = 2
        keys = [ObjectKey(h, MODEL, ObjectKey.ComputeKVRank(world, r, world, r), 0, "")
                for h in hashes for r in range(world)]
        desc = {0: MemoryLayoutDesc([torch.Size([2, L, CHUNK, H // world * D])], [torch.bfloat16])}
        bits = _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(keys, desc))
        assert bits.popcount() == len(keys)
        others = [ObjectKey(hashes[0], "another-model", keys[0].kv_rank, 0, ""),
                  ObjectKey(hashes[0], MODEL, keys[0].kv_rank, 0, "user-salt"),
                  ObjectKey(b"\0" * 32, MODEL, keys[0].kv_rank, 0, "")]
        assert _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(others, desc)).popcount() == 0
        objs = [SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H // world * D, dtype=torch.bfloat16)) for _ in keys]
        loaded = _wait(adapter, "load", adapter.submit_load_task(keys, objs))
        assert loaded.popcount() == len(keys)
        for n, obj in enumerate(objs):
            chunk, rank = divmod(n, world)
            want = kv[:, :, chunk * CHUNK:(chunk + 1) * CHUNK, rank * (H // world):(rank + 1) * (H // world)]
            assert torch.equal(obj.tensor, want.reshape(2, L, CHUNK, -1))
        # where the time went, per stage (`ttft.py --breakdown` reads them from the published record):
        # two lookup batches and one load of these keys; a KV_2LTD object needs no encoding
        stages = adapter.metrics.snapshot()["stages"]
        assert (stages["lookup"]["count"], stages["lookup"]["items"]) == (2, len(keys) + len(others))
        assert (stages["load"]["count"], stages["load"]["items"]) == (1, len(keys))
        assert stages["load"]["seconds"] > 0 and "encode" not in stages
        adapter.publish()
        (state,) = read_states(tmp_path / "cache")
        assert state.stages["load"] == stages["load"]
        # removed: no key hits any more
        reg.remove("doc")
        adapter.refresh()
        assert _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(keys, desc)).popcount() == 0
    finally:
        adapter.close()


class _L1:
    """The server's L1 as the adapter's purge sees it (`storage_manager.delete_l1_keys`): the keys
    it was told to delete, except those `locked` (LMCache skips a key a read holds, or one
    reserved for a load in flight, unless forced)."""

    def __init__(self) -> None:
        self.deleted: list = []
        self.locked: set = set()

    def delete_l1_keys(self, keys, force=False):
        skipped = [k for k in keys if k in self.locked and not force]
        gone = [k for k in keys if k not in skipped]
        self.deleted += gone
        return len(gone), len(skipped)


def test_client_kv_reaches_only_keys_naming_its_salt_and_its_removal_purges_them(tmp_path):
    """KV a client brought (`Entry.salt`) for a prompt the operator also serves, with other KV (a
    forged one: the prompt's ids over another text's KV). MP keys carry vLLM's request
    `cache_salt`: the client's chunks go to keys whose cache_salt is its salt, or the gateway's
    `salt:<the client's own>`, and to no other key: not unsalted (the operator's chunks go there,
    as before), not another salt, nor one that only looks like it. Removed, its chunks are purged
    from L1 under every salted key they were loaded for and the operator's stay."""
    L, H, D = 2, 2, 16
    ids = list(range(700, 700 + 2 * CHUNK))
    kvs = {"handbook": random_kv(L, 2 * CHUNK, H, D, seed=41), "brought": random_kv(L, 2 * CHUNK, H, D, seed=42)}
    for name, kv in kvs.items():
        pack_kv(kv, tmp_path / name, cartridge_id=name, model=MODEL, kind="first_k", token_ids=ids,
                chunk_size=CHUNK)
    reg = Registry(tmp_path / "reg.db")
    reg.register(tmp_path / "handbook")
    salt = reg.register(tmp_path / "brought", client=True).salt
    assert salt
    l1 = _L1()
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 3600})
    try:
        hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=l1))
        assert set(adapter.served_now()) == {"handbook", "brought"}, adapter.report_status()
        hashes = hasher.compute_chunk_hashes(ids)
        rank = ObjectKey.ComputeKVRank(1, 0, 1, 0)
        desc = {0: MemoryLayoutDesc([torch.Size([2, L, CHUNK, H * D])], [torch.bfloat16])}

        def keys(cache_salt: str) -> list:
            return [ObjectKey(h, MODEL, rank, 0, cache_salt) for h in hashes]

        def whose(cache_salt: str) -> list[str | None]:
            """As the server asks: lookup and lock, unlock, load; whose KV each chunk got."""
            ks = keys(cache_salt)
            hits = _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(ks, desc))
            adapter.submit_unlock([k for n, k in enumerate(ks) if hits.test(n)])
            objs = [SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H * D, dtype=torch.bfloat16)) for _ in ks]
            loaded = _wait(adapter, "load", adapter.submit_load_task(ks, objs))
            assert hits.popcount() == loaded.popcount(), cache_salt
            out = []
            for n, obj in enumerate(objs):
                got = [name for name, kv in kvs.items()
                       if torch.equal(obj.tensor, kv[:, :, n * CHUNK:(n + 1) * CHUNK].reshape(2, L, CHUNK, -1))]
                out.append(got[0] if loaded.test(n) else None)
            return out

        theirs = f"{salt}:user-7"  # the gateway's form for a client that sets its own cache_salt
        assert whose(salt) == ["brought", "brought"]
        assert whose(theirs) == ["brought", "brought"]
        assert whose("") == ["handbook", "handbook"]  # the prompt's own keys: the operator's, as before
        # the gateway's form for the operator's cartridges and a client's own cache_salt: an empty
        # cartridge salt, then the client's (its own prefix cache; the operator's chunks, never a client's)
        assert whose(":user-7") == ["handbook", "handbook"] and whose(f":{salt}") == ["handbook", "handbook"]
        for other in ("another-salt", f"another:{salt}", f"{salt}0", salt[:-1]):
            assert whose(other) == [None, None], other

        reg.remove("brought")
        assert adapter.refresh()
        assert set(l1.deleted) == set(keys(salt) + keys(theirs)), "the purge missed or overreached"
        assert whose(salt) == [None, None] and whose(theirs) == [None, None]
        assert whose("") == ["handbook", "handbook"] and whose(":user-7") == ["handbook", "handbook"]
        # the removed KV's salts are not kept for ever; the operator's keys (any ":<client's>") are
        assert {a[3] for a in adapter._asked} == {"", ":user-7", f":{salt}"}
        l1.deleted.clear()
        reg.remove("handbook")
        assert adapter.refresh()
        assert set(l1.deleted) == set(keys("") + keys(":user-7") + keys(f":{salt}")), "the purge missed a key"
    finally:
        adapter.close()


def test_two_models_cartridges_of_the_same_tokens_stay_apart(tmp_path):
    """The server's chunk hash chains token ids only: two models' cartridges of the same tokens
    have the same hashes and are told apart by the key's model name (each gets its own KV)."""
    L, H, D = 2, 2, 16
    ids = list(range(300, 300 + CHUNK))
    reg = Registry(tmp_path / "reg.db")
    kvs = {}
    for n, model in enumerate(("model-a", "model-b")):
        kvs[model] = random_kv(L, CHUNK, H, D, seed=20 + n)
        pack_kv(kvs[model], tmp_path / model, cartridge_id=f"doc-{model}", model=model, kind="first_k",
                token_ids=ids, chunk_size=CHUNK)
        reg.register(tmp_path / model)
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 60})
    try:
        hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        (h,) = hasher.compute_chunk_hashes(ids)
        rank = ObjectKey.ComputeKVRank(1, 0, 1, 0)
        keys = [ObjectKey(h, m, rank, 0, "") for m in kvs]
        objs = [SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H * D, dtype=torch.bfloat16)) for _ in keys]
        assert _wait(adapter, "load", adapter.submit_load_task(keys, objs)).popcount() == 2
        for model, obj in zip(kvs, objs):
            assert torch.equal(obj.tensor, kvs[model].reshape(2, L, CHUNK, -1)), model
    finally:
        adapter.close()


def test_a_server_serving_no_cartridge_of_its_engines_model_gives_the_refusal_reason(tmp_path):
    """The only cartridge of the engine's model is refused (another chunk size than the
    server's). The server still serves that model (a vLLM of it registered its KV layout with the
    server), so the gateway answers the refusal at once (400, the reason) instead of waiting
    for an instance of the model and answering 503."""
    from lmcache.v1.distributed.api import DEFAULT_ATTN_WINDOW_DESC
    from lmcache.v1.multiprocess.engine_context import LayoutDescRegistry

    from lmcache_cartridge.lmcache.serving import NotServed, Wanted, wait_served

    L, H, D = 2, 2, 16
    pack_kv(random_kv(L, 2 * CHUNK, H, D, seed=9), tmp_path / "doc", cartridge_id="doc", model=MODEL,
            kind="first_k", token_ids=list(range(2 * CHUNK)), chunk_size=2 * CHUNK)
    reg = Registry(tmp_path / "reg.db")
    entry = reg.register(tmp_path / "doc")
    layouts = LayoutDescRegistry()
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 60})
    try:
        adapter.attach(SimpleNamespace(token_hasher=TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor"),
                                       chunk_size=CHUNK, storage_manager=None, layout_desc_registry=layouts))
        layouts.register(MODEL, 1, MemoryLayoutDesc([torch.Size([2, L, CHUNK, H * D])], [torch.bfloat16]),
                         DEFAULT_ATTN_WINDOW_DESC)
        adapter.publish()
        (state,) = read_states(tmp_path / "cache")
        assert state.cartridges == {} and "doc" in state.skipped and MODEL in state.models
        wanted = [Wanted(entry.id, entry.content_hash, entry.epoch)]
        t0 = time.monotonic()
        with pytest.raises(NotServed) as e:
            wait_served(tmp_path / "cache", reg.path, wanted, timeout=2.0, models=[MODEL])
        assert e.value.status == 400 and "chunk" in str(e.value), e.value
        assert time.monotonic() - t0 < 1.0
    finally:
        adapter.close()


def test_bad_bytes_quarantine_the_cartridge_across_unrelated_registry_changes(tmp_path):
    """A flipped byte in a local payload: the load misses (nothing reaches L1) and the cartridge is
    quarantined with the reason; registering another cartridge does not bring it back."""
    from lmcache_cartridge.cartridge.manifest import PAYLOAD_NAME

    L, H, D = 2, 2, 16
    ids = list(range(500, 500 + CHUNK))
    pack_kv(random_kv(L, CHUNK, H, D, seed=9), tmp_path / "bad", cartridge_id="bad", model=MODEL,
            kind="first_k", token_ids=ids, chunk_size=CHUNK)
    reg = Registry(tmp_path / "reg.db")
    reg.register(tmp_path / "bad")
    payload = tmp_path / "bad" / PAYLOAD_NAME
    raw = bytearray(payload.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    payload.write_bytes(bytes(raw))
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 60})
    try:
        hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        key = ObjectKey(hasher.compute_chunk_hashes(ids)[0], MODEL, ObjectKey.ComputeKVRank(1, 0, 1, 0), 0, "")
        obj = SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H * D, dtype=torch.bfloat16))
        assert _wait(adapter, "load", adapter.submit_load_task([key], [obj])).popcount() == 0
        assert "bad" in adapter.report_status()["not_served"]
        pack_kv(random_kv(L, CHUNK, H, D, seed=10), tmp_path / "other", cartridge_id="other", model=MODEL,
                kind="first_k", token_ids=list(range(900, 900 + CHUNK)), chunk_size=CHUNK)
        reg.register(tmp_path / "other")
        assert adapter.refresh()
        status = adapter.report_status()
        assert status["cartridges"] == 1 and "bad" in status["not_served"]
        desc = {0: MemoryLayoutDesc([torch.Size([2, L, CHUNK, H * D])], [torch.bfloat16])}
        assert _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task([key], desc)).popcount() == 0
    finally:
        adapter.close()


def test_doctor_fails_on_an_adapter_the_server_module_never_attached(tmp_path, capsys):
    """Without `--server-module` the adapter serves nothing (it has no hasher): its serving state
    says so and `doctor`, reading the same registry and cache, fails naming the fix."""
    from lmcache_cartridge.tools.cli import main

    reg, cache = tmp_path / "reg.db", tmp_path / "cache"
    Registry(reg)
    yaml_path = tmp_path / "lmc.yaml"
    yaml_path.write_text(
        "chunk_size: 64\nlocal_cpu: true\nmax_local_cpu_size: 1\nstorage_plugins: [\"cartridge\"]\n"
        "pre_caching_hash_algorithm: sha256_cbor\nextra_config:\n"
        "  storage_plugin.cartridge.module_path: lmcache_cartridge.plugin\n"
        "  storage_plugin.cartridge.class_name: CartridgeStoragePlugin\n"
        f"  storage_plugin.cartridge.registry: {reg}\n  storage_plugin.cartridge.cache_dir: {cache}\n")
    adapter = CartridgeL2Adapter({"registry": str(reg), "cache_dir": str(cache), "refresh_seconds": 60})
    try:
        adapter.publish()
        rc = main(["doctor", "--config", str(yaml_path)])
        out = capsys.readouterr().out
        assert rc == 1 and "LMCache MP server" in out and "--server-module" in out, out
    finally:
        adapter.close()


def test_a_locked_disk_only_chunk_survives_another_cartridges_download_until_unlocked(tmp_path, moto_server, s3_proxy):
    """The soak's broken promise, in MP mode. The adapter has no CPU tier, so a trained S3
    cartridge X lives on the disk tier only; the server's lookup locks X's chunk, then another
    trained cartridge Y is registered and downloaded into a disk tier with room for one chunk,
    then the server loads X. A lookup that locked nothing would let Y's download evict X's file
    and the load miss a chunk the lookup had promised: the lock holds X's file, the load fills
    X's exact bytes without a request to S3; after the server's unlock Y's next download may
    evict X."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey

    from lmcache_cartridge.cartridge.packed import VocabInfo
    from lmcache_cartridge.store.registration import register_s3
    from lmcache_cartridge.store.s3 import S3Settings
    from s3_server import s3_client, upload_dir

    L, H, D = 2, 2, 16
    chunk_bytes = 2 * L * CHUNK * H * D * 2
    kvs, ms = {}, {}
    for n, name in enumerate(("mp-x", "mp-y")):
        kvs[name] = random_kv(L, CHUNK, H, D, seed=80 + n)
        ms[name] = pack_kv(kvs[name], tmp_path / name, cartridge_id=name, model=MODEL, kind="trained",
                           vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
        upload_dir(s3_client(moto_server), "mp-hot", f"c/{name}", tmp_path / name)
    reg = Registry(tmp_path / "reg.db")
    s3 = S3Settings.from_mapping({"endpoint_url": s3_proxy.endpoint_url})
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 3600, "disk_budget_gb": chunk_bytes / (1 << 30),
                                  "s3.endpoint_url": s3_proxy.endpoint_url})

    def resident(name):
        s = adapter._state.served[name]
        h = s.handle(1, 0)
        return adapter.residency.resident(h) and not adapter.residency.downloading(h)

    try:
        hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        register_s3(reg, "s3://mp-hot/c/mp-x", tmp_path / "cache", s3)
        assert adapter.refresh()  # trained: downloaded at once
        deadline = time.time() + 30
        while not resident("mp-x") and time.time() < deadline:
            time.sleep(0.02)
        assert resident("mp-x")
        m = ms["mp-x"]
        key = ObjectKey(hasher.compute_chunk_hashes(list(m.key_token_ids))[m.context_chunks],
                        MODEL, ObjectKey.ComputeKVRank(1, 0, 1, 0), 0, "")
        desc = {0: MemoryLayoutDesc([torch.Size([2, L, CHUNK, H * D])], [torch.bfloat16])}
        assert _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task([key], desc)).popcount() == 1
        register_s3(reg, "s3://mp-hot/c/mp-y", tmp_path / "cache", s3)
        assert adapter.refresh()
        hy = adapter._state.served["mp-y"].handle(1, 0)
        deadline = time.time() + 30
        while (s3_proxy.count("GET", r"mp-y/kv\.bin$") < 1 or adapter.residency.downloading(hy)) \
                and time.time() < deadline:
            time.sleep(0.02)
        gets = s3_proxy.count("GET", r"/kv\.bin$")
        obj = SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H * D, dtype=torch.bfloat16))
        assert _wait(adapter, "load", adapter.submit_load_task([key], [obj])).popcount() == 1, \
            "the load missed a chunk its lookup locked"
        assert torch.equal(obj.tensor, kvs["mp-x"].reshape(2, L, CHUNK, -1))
        assert s3_proxy.count("GET", r"/kv\.bin$") == gets  # from the disk, never from S3
        adapter.submit_unlock([key])
        assert not adapter._leases
        adapter.residency.download_async(hy)  # Y again: now X's file may go
        deadline = time.time() + 30
        while not resident("mp-y") and time.time() < deadline:
            time.sleep(0.02)
        assert resident("mp-y") and not resident("mp-x")
    finally:
        adapter.close()


def test_lookup_locks_the_server_never_returns_let_go_after_the_lease(tmp_path, moto_server, s3_proxy):
    """A lookup result nobody takes is never unlocked by the server: its disk holds go when the
    lease expires (the file is evictable again), and a late unlock then ends the expired lock,
    never a newer lookup's on the same key (`lmcache.leases`); close releases the holds still
    open."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey

    from lmcache_cartridge.cartridge.packed import VocabInfo
    from lmcache_cartridge.store.registration import register_s3
    from lmcache_cartridge.store.s3 import S3Settings
    from s3_server import s3_client, upload_dir

    L, H, D = 2, 2, 16
    m = pack_kv(random_kv(L, CHUNK, H, D, seed=90), tmp_path / "mp-z", cartridge_id="mp-z", model=MODEL,
                kind="trained", vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
    upload_dir(s3_client(moto_server), "mp-lease", "c/mp-z", tmp_path / "mp-z")
    reg = Registry(tmp_path / "reg.db")
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 3600, "pin_lease_seconds": 0.0,
                                  "s3.endpoint_url": s3_proxy.endpoint_url})
    try:
        hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        register_s3(reg, "s3://mp-lease/c/mp-z", tmp_path / "cache",
                    S3Settings.from_mapping({"endpoint_url": s3_proxy.endpoint_url}))
        assert adapter.refresh()
        h = adapter._state.served["mp-z"].handle(1, 0)
        deadline = time.time() + 30
        while not (adapter.residency.resident(h) and not adapter.residency.downloading(h)) and time.time() < deadline:
            time.sleep(0.02)
        key = ObjectKey(hasher.compute_chunk_hashes(list(m.key_token_ids))[m.context_chunks],
                        MODEL, ObjectKey.ComputeKVRank(1, 0, 1, 0), 0, "")
        desc = {0: MemoryLayoutDesc([torch.Size([2, L, CHUNK, H * D])], [torch.bfloat16])}
        for _ in range(2):
            assert _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task([key], desc)).popcount() == 1
        holds = [lock.hold for lock in adapter._leases.held(key)]
        assert len(holds) == 2 and all(hd is not None and hd.held for hd in holds)
        time.sleep(0.01)
        adapter._expire_leases()  # what the watcher runs every refresh period
        assert not any(hd.held for hd in holds) and not adapter._leases
        assert _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task([key], desc)).popcount() == 1
        newer = adapter._leases.held(key)[0].hold
        adapter.submit_unlock([key, key])  # late, for the two expired locks: the newer one stays
        assert newer.held and [lock.hold for lock in adapter._leases.held(key)] == [newer]
        open_at_close = newer
    finally:
        adapter.close()
    assert not open_at_close.held


def test_the_adapter_syncs_its_catalog_and_serves_what_is_published(tmp_path, moto_server, s3_proxy):
    """`catalog_uri` in the adapter's params (the plugin's setting, from the same YAML): once the
    server attaches it, the adapter syncs the S3 catalog into its registry as the in-process plugin
    does, so a published cartridge is served and an unpublished one no longer is. The server is
    the host's only LMCache process in MP mode: without this nothing would sync the catalog."""
    from lmcache_cartridge.store.catalog import publish, unpublish
    from lmcache_cartridge.store.s3 import S3Settings
    from s3_server import s3_client

    s3_client(moto_server).create_bucket(Bucket="mp-catalog")
    catalog = "s3://mp-catalog/catalog"
    ids = list(range(100, 100 + 2 * CHUNK))
    pack_kv(random_kv(2, 2 * CHUNK, 2, 16, seed=91), tmp_path / "doc", cartridge_id="mp-cat", model=MODEL,
            kind="first_k", token_ids=ids, chunk_size=CHUNK)
    adapter = CartridgeL2Adapter({"registry": str(tmp_path / "reg.db"), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 0.1, "catalog_uri": catalog, "catalog_period": 0.2,
                                  "s3.endpoint_url": s3_proxy.endpoint_url})

    def served() -> bool:
        with adapter._lock:
            return "mp-cat" in adapter._state.served

    def until(want: bool) -> bool:
        deadline = time.time() + 30
        while served() != want and time.time() < deadline:
            time.sleep(0.05)
        return served() == want

    try:
        hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        publish(tmp_path / "doc", catalog, S3Settings(endpoint_url=s3_proxy.endpoint_url))
        assert until(True), adapter.summary()
        assert adapter._state.served["mp-cat"].entry.catalog == catalog
        unpublish("mp-cat", catalog, S3Settings(endpoint_url=s3_proxy.endpoint_url))
        assert until(False), adapter.summary()
    finally:
        adapter.close()
    assert adapter._catalog_sync is not None and not adapter._catalog_sync._thread.is_alive()


def test_a_trained_cartridge_evicted_from_the_disk_tier_is_downloaded_again(tmp_path, moto_server, s3_proxy):
    """The gateway forwards a trained request only once its cartridge is resident (every chunk
    local: a lookup miss would leave placeholder ids to compute), and nothing else asks the
    adapter for it. Trained S3 cartridge X is downloaded at registration, then Y's download evicts
    it from a disk tier with room for one chunk, then Y goes. Fetched only at registration or on
    a lookup miss, X would stay evicted and every request for it be answered 503 by the gateway
    for good (the MP soak's reference request): the watcher fetches an
    evicted trained cartridge again, as the in-process plugin does, and X is resident again
    without any lookup."""
    from lmcache_cartridge.cartridge.packed import VocabInfo
    from lmcache_cartridge.store.registration import register_s3
    from lmcache_cartridge.store.s3 import S3Settings
    from s3_server import s3_client, upload_dir

    L, H, D = 2, 2, 16
    chunk_bytes = 2 * L * CHUNK * H * D * 2
    for n, name in enumerate(("mp-ev-x", "mp-ev-y")):
        pack_kv(random_kv(L, CHUNK, H, D, seed=60 + n), tmp_path / name, cartridge_id=name, model=MODEL,
                kind="trained", vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
        upload_dir(s3_client(moto_server), "mp-evict", f"c/{name}", tmp_path / name)
    reg = Registry(tmp_path / "reg.db")
    s3 = S3Settings.from_mapping({"endpoint_url": s3_proxy.endpoint_url})
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 0.05, "disk_budget_gb": chunk_bytes / (1 << 30),
                                  "s3.endpoint_url": s3_proxy.endpoint_url})

    def until(cond, what: str, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while not cond():
            assert time.time() < deadline, what
            time.sleep(0.02)

    def resident(name: str) -> bool:
        s = adapter._state.served.get(name)
        return s is not None and adapter.residency.resident(s.handle(1, 0))

    try:
        adapter.attach(SimpleNamespace(token_hasher=TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor"),
                                       chunk_size=CHUNK, storage_manager=None))
        register_s3(reg, "s3://mp-evict/c/mp-ev-x", tmp_path / "cache", s3)
        until(lambda: resident("mp-ev-x"), "X downloaded at registration")
        register_s3(reg, "s3://mp-evict/c/mp-ev-y", tmp_path / "cache", s3)
        until(lambda: s3_proxy.count("GET", r"mp-ev-y/kv\.bin$") >= 1 and resident("mp-ev-y"),
              "Y downloaded at registration")
        reg.remove("mp-ev-y")
        until(lambda: "mp-ev-y" not in adapter._state.served, "Y no longer served")
        gets = s3_proxy.count("GET", r"mp-ev-x/kv\.bin$")
        until(lambda: resident("mp-ev-x"), "X, evicted by Y's download, is never fetched again", timeout=10)
        assert s3_proxy.count("GET", r"mp-ev-x/kv\.bin$") >= gets
        assert s3_proxy.count("GET", r"mp-ev-x/kv\.bin$") >= 2  # fetched again, not kept
    finally:
        adapter.close()


def test_the_server_runs_under_this_interpreter_without_an_lmcache_script_beside_it(tmp_path, monkeypatch):
    """As where LMCache was installed with `pip install --target` (the CUDA box): no `lmcache`
    console script beside the interpreter, and the `lmcache` PATH finds first is another
    environment's, which cannot import the adapter. The server still starts, from this interpreter,
    and its adapter publishes what it serves."""
    import os
    import site
    import sys
    from pathlib import Path

    from lmcache_cartridge.tools.lmcache_server import LmcacheServer

    bare, other = tmp_path / "bin", tmp_path / "other-env"
    bare.mkdir(), other.mkdir()
    (bare / "python3").symlink_to(os.path.realpath(sys.executable))
    (other / "lmcache").write_text("#!/bin/sh\necho another environment >&2\nexit 3\n")
    (other / "lmcache").chmod(0o755)
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setattr(sys, "executable", str(bare / "python3"))
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), *site.getsitepackages()]))
    params = {"registry": str(tmp_path / "registry.db"), "cache_dir": str(tmp_path / "cache"), "prefault_l1": False}
    with LmcacheServer(tmp_path / "server", params, l1_size_gb=0.0625) as server:
        server.wait_ready()
        assert server.command[0] == str(bare / "python3")
        deadline = time.time() + 60
        while not [s for s in read_states(tmp_path / "cache") if s.role == "mp-server"] and time.time() < deadline:
            time.sleep(0.2)
        assert [s for s in read_states(tmp_path / "cache") if s.role == "mp-server"], server.log_tail()


def test_a_touched_chunk_stays_on_the_disk_tier_when_another_download_needs_room(tmp_path, moto_server, s3_proxy):
    """LMCache's server marks keys used without loading them (`submit_touch`, LMCache 0.5.7: a
    lookup's prefix vLLM's own prefix cache holds, a session's keys at its end). Three trained S3
    cartridges of one chunk each, a disk tier with room for two: X then Y are downloaded (X the
    least recently used), the server touches X's key, then Z's download needs room. Without the
    touch (0.5.6 has none, 0.5.7's default only tells LMCache's listeners) Z would evict X, which
    vLLM is still using: the touch keeps X's file warm and Z evicts Y. A key the adapter does not serve is
    not touched; LMCache's listeners hear of X's key."""
    from lmcache_cartridge.cartridge.packed import VocabInfo
    from lmcache_cartridge.store.registration import register_s3
    from lmcache_cartridge.store.s3 import S3Settings
    from s3_server import s3_client, upload_dir

    L, H, D = 2, 2, 16
    chunk_bytes = 2 * L * CHUNK * H * D * 2
    ms = {}
    for n, name in enumerate(("mp-t-x", "mp-t-y", "mp-t-z")):
        ms[name] = pack_kv(random_kv(L, CHUNK, H, D, seed=70 + n), tmp_path / name, cartridge_id=name, model=MODEL,
                           kind="trained", vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
        upload_dir(s3_client(moto_server), "mp-touch", f"c/{name}", tmp_path / name)
    reg = Registry(tmp_path / "reg.db")
    s3 = S3Settings.from_mapping({"endpoint_url": s3_proxy.endpoint_url})
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 3600, "disk_budget_gb": 2 * chunk_bytes / (1 << 30),
                                  "s3.endpoint_url": s3_proxy.endpoint_url})
    heard = []
    adapter.register_listener(SimpleNamespace(on_l2_keys_accessed=heard.extend))
    hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")

    def resident(name: str) -> bool:
        s = adapter._state.served.get(name)
        if s is None:
            return False
        h = s.handle(1, 0)
        return adapter.residency.resident(h) and not adapter.residency.downloading(h)

    def register(name: str) -> None:
        register_s3(reg, f"s3://mp-touch/c/{name}", tmp_path / "cache", s3)
        assert adapter.refresh()  # trained: downloaded at once
        deadline = time.time() + 30
        while not resident(name):
            assert time.time() < deadline, f"{name} never downloaded"
            time.sleep(0.02)

    def key(name: str, model: str = MODEL) -> ObjectKey:
        m = ms[name]
        return ObjectKey(hasher.compute_chunk_hashes(list(m.key_token_ids))[m.context_chunks], model,
                         ObjectKey.ComputeKVRank(1, 0, 1, 0), 0, "")

    try:
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        register("mp-t-x")
        register("mp-t-y")
        adapter.submit_touch([key("mp-t-x"), key("mp-t-y", "another-model")])
        register("mp-t-z")
        assert resident("mp-t-x") and not resident("mp-t-y"), "the touched chunk was evicted"
        assert heard == [key("mp-t-x")]
    finally:
        adapter.close()


def test_memory_tags_say_host_storage_on_this_host(tmp_path):
    """LMCache 0.5.7 asks each L2 adapter for its memory tags and filters prefetches by them: every
    load of ours reads a file on this host (a local origin, or the host's disk tier: an S3 chunk
    misses until downloaded), so STORAGE/LOCAL; LMCache's own filter admits it where local storage
    is allowed and keeps it out where a request allows no L2 (its P2P controller's peers)."""
    api = pytest.importorskip("lmcache.v1.distributed.api")
    if not hasattr(api, "MemoryTags"):
        pytest.skip("LMCache before 0.5.7 has no memory tags")
    from lmcache.v1.distributed.storage_controllers.prefetch_controller import _tags_allowed

    adapter = CartridgeL2Adapter({"registry": str(tmp_path / "reg.db"), "cache_dir": str(tmp_path / "cache")})
    try:
        tags = adapter.get_memory_tags()
    finally:
        adapter.close()
    assert tags == api.MemoryTags(api.MemorySegment.STORAGE, api.MemoryResidency.LOCAL)
    assert _tags_allowed(tags, frozenset({api.MemoryTags(api.MemorySegment.STORAGE, api.MemoryResidency.LOCAL)}))
    assert not _tags_allowed(tags, frozenset())


def _tp_setup(tmp_path, moto_server, s3_proxy, names, *, chunks: int = 2):
    """Trained by-head cartridges `names` of `chunks` chunks each (L=2, H=4, D=16), uploaded to a
    moto S3 bucket; an adapter whose disk tier holds exactly one of them and whose watcher never
    runs on its own (the test calls `_keep_trained_resident`, what it runs every refresh period); the
    server's layout registry, where engines register (what `_engines` reads)."""
    from lmcache.v1.multiprocess.engine_context import LayoutDescRegistry

    from lmcache_cartridge.cartridge.packed import VocabInfo
    from s3_server import s3_client, upload_dir

    L, H, D = 2, 4, 16
    ms = {}
    for n, name in enumerate(names):
        ms[name] = pack_kv(random_kv(L, chunks * CHUNK, H, D, seed=110 + n), tmp_path / name, cartridge_id=name,
                           model=MODEL, kind="trained", vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
        assert ms[name].layout == "by_head"
        upload_dir(s3_client(moto_server), "mp-tp", f"c/{name}", tmp_path / name)
    cartridge_bytes = chunks * 2 * L * CHUNK * H * D * 2
    adapter = CartridgeL2Adapter({"registry": str(tmp_path / "reg.db"), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 3600, "disk_budget_gb": cartridge_bytes / (1 << 30),
                                  "s3.endpoint_url": s3_proxy.endpoint_url})
    layouts = LayoutDescRegistry()
    hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
    adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None,
                                   layout_desc_registry=layouts))
    return adapter, layouts, hasher, ms, (L, H, D)


def _attach_engine(layouts, world: int, L: int, H: int, D: int) -> None:
    """An engine of `world` ranks registers its KV layout with the server (one rank's object)."""
    from lmcache.v1.distributed.api import DEFAULT_ATTN_WINDOW_DESC

    layouts.register(MODEL, world, MemoryLayoutDesc([torch.Size([2, L, CHUNK, H // world * D])], [torch.bfloat16]),
                     DEFAULT_ATTN_WINDOW_DESC)


def _until(cond, what: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.02)


def _published_local(tmp_path, name: str) -> bool:
    """What the gateway reads: the adapter's published record says every chunk of `name` is local."""
    (state,) = read_states(tmp_path / "cache")
    c = state.cartridges.get(name)
    return c is not None and c.all_resident


def _ranks_resident(adapter, name: str, world: int) -> list[bool]:
    """For each rank of an engine of `world` ranks: every chunk of `name` it reads is local."""
    s = adapter._state.served[name]
    return [adapter.residency.resident(s.handle(world, r)) for r in range(world)]


def test_a_trained_s3_cartridge_is_fetched_for_each_rank_of_a_tensor_parallel_engine(tmp_path, moto_server,
                                                                                     s3_proxy):
    """An engine of world size 2 is attached to the server; a trained by-head cartridge X on S3 is
    registered. Each rank's lookups and loads read its own heads' bytes (`Handle.chunk_id` carries
    the heads), so X is ready only once both ranks' bytes are on the disk tier. Fetching and
    checking X's whole chunks (world size 1) only, the published record would say X was local
    while neither rank's lookup hit, and the gateway forward a trained request whose KV the server
    could not load. The record says local only once both ranks' bytes are, every key of each
    rank hits and loads that rank's heads, and after another download evicted them the watcher
    fetches each rank's bytes again."""
    from lmcache_cartridge.cartridge.packed import PackedCartridge
    from lmcache_cartridge.store.registration import register_s3
    from lmcache_cartridge.store.s3 import S3Settings

    adapter, layouts, hasher, ms, (L, H, D) = _tp_setup(tmp_path, moto_server, s3_proxy, ("mp-tp-x", "mp-tp-y"))
    reg = Registry(tmp_path / "reg.db")
    s3 = S3Settings.from_mapping({"endpoint_url": s3_proxy.endpoint_url})
    world, hd = 2, H // 2
    try:
        _attach_engine(layouts, world, L, H, D)
        register_s3(reg, "s3://mp-tp/c/mp-tp-x", tmp_path / "cache", s3)
        assert adapter.refresh()  # trained: downloaded at once
        _until(lambda: _published_local(tmp_path, "mp-tp-x"), "X never published as local")
        assert _ranks_resident(adapter, "mp-tp-x", world) == [True, True], \
            "published as local while a rank's bytes are not on the disk tier"

        m = ms["mp-tp-x"]
        hashes = hasher.compute_chunk_hashes(list(m.key_token_ids))[m.context_chunks:]
        assert len(hashes) == 2
        desc = {0: MemoryLayoutDesc([torch.Size([2, L, CHUNK, hd * D])], [torch.bfloat16])}
        gets = s3_proxy.count("GET", r"mp-tp-x/kv\.bin$")
        with PackedCartridge(tmp_path / "mp-tp-x") as oracle:
            for rank in range(world):
                keys = [ObjectKey(h, MODEL, ObjectKey.ComputeKVRank(world, rank, world, rank), 0, "") for h in hashes]
                bits = _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(keys, desc))
                assert bits.popcount() == len(keys), f"rank {rank}'s lookup missed chunks of a resident cartridge"
                objs = [SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, hd * D, dtype=torch.bfloat16)) for _ in keys]
                assert _wait(adapter, "load", adapter.submit_load_task(keys, objs)).popcount() == len(keys)
                adapter.submit_unlock(keys)
                for i, obj in enumerate(objs):
                    want = oracle.read_chunk(i)[..., rank * hd * D:(rank + 1) * hd * D]
                    assert torch.equal(obj.tensor, want), f"rank {rank}, chunk {i}: not its heads' bytes"
        assert s3_proxy.count("GET", r"mp-tp-x/kv\.bin$") == gets  # served from the disk tier
        assert not adapter._leases

        # Y's ranks fill the disk tier (room for one cartridge): X's ranks are evicted
        register_s3(reg, "s3://mp-tp/c/mp-tp-y", tmp_path / "cache", s3)
        assert adapter.refresh()
        _until(lambda: _ranks_resident(adapter, "mp-tp-y", world) == [True, True], "Y never downloaded")
        assert _ranks_resident(adapter, "mp-tp-x", world) == [False, False]
        adapter.publish()
        assert not _published_local(tmp_path, "mp-tp-x")
        reg.remove("mp-tp-y")
        adapter.refresh()
        adapter._keep_trained_resident()  # what the watcher runs every refresh period
        _until(lambda: _ranks_resident(adapter, "mp-tp-x", world) == [True, True],
               "X's ranks, evicted by Y's download, are never fetched again")
        _until(lambda: _published_local(tmp_path, "mp-tp-x"), "X never published as local again")
        assert s3_proxy.count("GET", r"mp-tp-x/kv\.bin$") >= gets + world * len(hashes)
    finally:
        adapter.close()


def test_an_engine_attached_after_its_trained_cartridge_gets_its_ranks_bytes(tmp_path, moto_server, s3_proxy):
    """A trained by-head cartridge on S3 is downloaded whole while no engine is attached (what an
    engine of world size 1 reads). Then an engine of world size 2 attaches (and one of world size
    3, whose heads do not split: never served, never fetched for): the record stops saying the
    cartridge is local, stays so while only one rank's bytes are, and the watcher fetches the
    other rank's, after which it says local again."""
    from lmcache_cartridge.store.registration import register_s3
    from lmcache_cartridge.store.s3 import S3Settings

    adapter, layouts, _hasher, _ms, (L, H, D) = _tp_setup(tmp_path, moto_server, s3_proxy, ("mp-tp-late",))
    reg = Registry(tmp_path / "reg.db")
    try:
        register_s3(reg, "s3://mp-tp/c/mp-tp-late", tmp_path / "cache",
                    S3Settings.from_mapping({"endpoint_url": s3_proxy.endpoint_url}))
        assert adapter.refresh()
        _until(lambda: _published_local(tmp_path, "mp-tp-late"), "never published as local")
        assert _ranks_resident(adapter, "mp-tp-late", 1) == [True]

        _attach_engine(layouts, 2, L, H, D)
        _attach_engine(layouts, 3, L, H, D)
        adapter.publish()
        assert not _published_local(tmp_path, "mp-tp-late"), "local for a world-2 engine whose ranks have no bytes"
        s = adapter._state.served["mp-tp-late"]
        adapter.residency.download_async(s.handle(2, 0)).result()
        adapter.publish()
        assert _ranks_resident(adapter, "mp-tp-late", 2) == [True, False]
        assert not _published_local(tmp_path, "mp-tp-late"), "local with rank 1's bytes missing"
        adapter._keep_trained_resident()  # what the watcher runs every refresh period
        _until(lambda: _ranks_resident(adapter, "mp-tp-late", 2) == [True, True], "rank 1's bytes never fetched")
        _until(lambda: _published_local(tmp_path, "mp-tp-late"), "never published as local again")
    finally:
        adapter.close()


def test_a_corrupted_disk_tier_chunk_is_dropped_and_fetched_again_never_served(tmp_path, moto_server, s3_proxy):
    """The adapter's only tier is the host's disk cache: a trained S3 cartridge's chunk lives there
    as a file from its download on. One byte of a chunk file flipped on disk (bit rot, another
    program writing into the cache dir), then the server looks it up and loads it. The load
    checks the file against the chunk's digest, drops it (a miss: the lookup's promise fails, the
    request fails rather than reads wrong KV), fetches the chunk again from S3 (one GET) and the
    next load fills the cartridge's exact bytes; the other chunk is served as it is."""
    from lmcache_cartridge.cartridge.packed import PackedCartridge
    from lmcache_cartridge.store.registration import register_s3
    from lmcache_cartridge.store.s3 import S3Settings

    adapter, _layouts, hasher, ms, (L, H, D) = _tp_setup(tmp_path, moto_server, s3_proxy, ("mp-rot",))
    reg = Registry(tmp_path / "reg.db")
    kv_bin = r"mp-rot/kv\.bin$"
    try:
        register_s3(reg, "s3://mp-tp/c/mp-rot", tmp_path / "cache",
                    S3Settings.from_mapping({"endpoint_url": s3_proxy.endpoint_url}))
        assert adapter.refresh()  # trained: downloaded at once
        h = adapter._state.served["mp-rot"].handle(1, 0)
        _until(lambda: adapter.residency.resident(h) and not adapter.residency.downloading(h), "never downloaded")
        (chunk0,) = (tmp_path / "cache" / "chunks").glob("*/0.chunk")  # the real file of chunk 0
        good = chunk0.read_bytes()
        # a write within the file-time tick of the download's own looks unchanged where the kernel
        # keeps coarse file times (`disk_cache._signature`): flip it once that tick has passed
        time.sleep(max(0.0, chunk0.stat().st_ctime + 0.05 - time.time()))
        with open(chunk0, "r+b") as f:  # in place: same file, one byte
            f.seek(len(good) // 3)
            f.write(bytes([good[len(good) // 3] ^ 0x10]))
        gets = s3_proxy.count("GET", kv_bin)

        m = ms["mp-rot"]
        keys = [ObjectKey(k, MODEL, ObjectKey.ComputeKVRank(1, 0, 1, 0), 0, "")
                for k in hasher.compute_chunk_hashes(list(m.key_token_ids))[m.context_chunks:]]
        desc = {0: MemoryLayoutDesc([torch.Size([2, L, CHUNK, H * D])], [torch.bfloat16])}

        def load() -> tuple[list[bool], list[torch.Tensor]]:
            """As the server does: lookup and lock, load, unlock."""
            hits = _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(keys, desc))
            locked = [k for n, k in enumerate(keys) if hits.test(n)]
            objs = [SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H * D, dtype=torch.bfloat16)) for _ in keys]
            loaded = _wait(adapter, "load", adapter.submit_load_task(locked, objs[:len(locked)]))
            adapter.submit_unlock(locked)
            return [loaded.test(n) for n in range(len(locked))] + [False] * (len(keys) - len(locked)), \
                [o.tensor for o in objs]

        with PackedCartridge(tmp_path / "mp-rot") as oracle:
            want = [oracle.read_chunk(i) for i in range(len(keys))]
        ok, got = load()
        for i, (o, t) in enumerate(zip(ok, got)):
            assert not o or torch.equal(t, want[i]), f"chunk {i}: the corrupted file's bytes were served"
        assert ok == [False, True], "the corrupted chunk must miss, the intact one load"
        _until(lambda: adapter.residency.resident(h) and not adapter.residency.downloading(h),
               "the dropped chunk is never fetched again")
        assert s3_proxy.count("GET", kv_bin) == gets + 1  # that chunk only, from the origin
        assert chunk0.read_bytes() == good
        ok, got = load()
        assert ok == [True, True] and all(torch.equal(t, w) for t, w in zip(got, want))
        assert not adapter._leases
    finally:
        adapter.close()


class _Paused:
    """The adapter's reads (`Residency.read_into`) with the `at`-th one held until `go` is set: a
    load in flight, its first chunks read and the rest not yet, for as long as the test needs."""

    def __init__(self, residency, at: int) -> None:
        self.read, self.at, self.calls = residency.read_into, at, 0
        self.reading, self.go = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            self.reading.set()
            assert self.go.wait(30), "never let go"
        return self.read(*args, **kwargs)


def _versions(tmp_path, names, chunks: int = 4):
    """First-k cartridges of one document (`chunks` chunks, the same ids), all with the id "doc",
    each with other KV: the versions of a cartridge an operator re-packs and registers again."""
    L, H, D = 2, 2, 16
    ids = list(range(1000, 1000 + chunks * CHUNK))
    kvs = {}
    for n, name in enumerate(names):
        kvs[name] = random_kv(L, chunks * CHUNK, H, D, seed=130 + n)
        pack_kv(kvs[name], tmp_path / name, cartridge_id="doc", model=MODEL, kind="first_k", token_ids=ids,
                chunk_size=CHUNK)
    hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
    keys = [ObjectKey(h, MODEL, ObjectKey.ComputeKVRank(1, 0, 1, 0), 0, "") for h in hasher.compute_chunk_hashes(ids)]
    return hasher, keys, kvs, (L, H, D)


def _whose(kvs, objs, bits, L: int) -> list[str | None]:
    """Which version's bytes each loaded object holds (None: not loaded)."""
    out = []
    for n, obj in enumerate(objs):
        got = [name for name, kv in kvs.items()
               if torch.equal(obj.tensor, kv[:, :, n * CHUNK:(n + 1) * CHUNK].reshape(2, L, CHUNK, -1))]
        assert not bits.test(n) or len(got) == 1, f"chunk {n} loaded with bytes of no version"
        out.append(got[0] if bits.test(n) else None)
    return out


@pytest.mark.parametrize("change", ["replaced", "removed"])
def test_a_registry_change_during_a_load_never_mixes_old_and_new_bytes(tmp_path, monkeypatch, change):
    """A cartridge of four chunks is looked up and locked, and its load is in flight (its first
    chunk read, the rest not yet) when the operator registers other KV under its id (the same
    document: the same keys) or removes it, and the adapter refreshes. The load fills either all
    the old chunks or none: never the old first chunk and the new rest, nor new bytes under keys
    the lookup locked for the old ones; what L1 holds under those keys (the load's objects,
    reserved and locked meanwhile) is purged once unlocked; then a lookup and load fill the new
    version whole (or nothing, removed), and no lock is left."""
    hasher, keys, kvs, (L, H, D) = _versions(tmp_path, ("old", "new"))
    reg = Registry(tmp_path / "reg.db")
    reg.register(tmp_path / "old")
    l1 = _L1()
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 3600})
    desc = {0: MemoryLayoutDesc([torch.Size([2, L, CHUNK, H * D])], [torch.bfloat16])}

    def objects() -> list:
        return [SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H * D, dtype=torch.bfloat16)) for _ in keys]

    try:
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=l1))
        assert _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(keys, desc)).popcount() == len(keys)
        l1.locked |= set(keys)  # the server reserved an L1 object per key for the load
        paused = _Paused(adapter.residency, at=2)
        monkeypatch.setattr(adapter.residency, "read_into", paused)
        objs = objects()
        tid = adapter.submit_load_task(keys, objs)
        assert paused.reading.wait(30), "the load never reached its second chunk"
        if change == "replaced":
            reg.register(tmp_path / "new")
        else:
            reg.remove("doc")
        assert adapter.refresh()
        paused.go.set()
        got = _whose(kvs, objs, _wait(adapter, "load", tid), L)
        assert got in ([None] * len(keys), ["old"] * len(keys)), f"a mix of versions was loaded: {got}"
        adapter.submit_unlock(keys)  # the server, done with the load: its objects are unlocked
        l1.locked.clear()
        assert not adapter._leases
        adapter._purge_tombstones()  # what the watcher runs every refresh period
        assert set(keys) <= set(l1.deleted), "L1 keeps what the load in flight put under the old keys"

        assert _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(keys, desc)).popcount() == \
            (len(keys) if change == "replaced" else 0)
        objs = objects()
        got = _whose(kvs, objs, _wait(adapter, "load", adapter.submit_load_task(keys, objs)), L)
        adapter.submit_unlock(keys)
        assert got == (["new"] * len(keys) if change == "replaced" else [None] * len(keys))
        assert not adapter._leases
    finally:
        adapter.close()


def test_a_load_after_a_replacement_never_serves_new_bytes_for_the_old_lookups_locks(tmp_path):
    """The server looked up and locked a cartridge's keys; before its load the operator registers
    other KV under the cartridge's id (the same keys) and the adapter refreshes. The load misses:
    the lookup promised the old bytes, and a request whose first chunks came from L1's old copy
    would get the new KV for the rest. The next lookup locks the new bytes and its load fills
    them whole, and re-registering the same bytes from elsewhere does not cost that lookup its
    load (the content hash is the same)."""
    import shutil

    hasher, keys, kvs, (L, H, D) = _versions(tmp_path, ("old", "new"))
    reg = Registry(tmp_path / "reg.db")
    reg.register(tmp_path / "old")
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 3600})
    desc = {0: MemoryLayoutDesc([torch.Size([2, L, CHUNK, H * D])], [torch.bfloat16])}

    def lookup_then(change) -> list[str | None]:
        assert _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(keys, desc)).popcount() == len(keys)
        change()
        assert adapter.refresh()
        objs = [SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H * D, dtype=torch.bfloat16)) for _ in keys]
        got = _whose(kvs, objs, _wait(adapter, "load", adapter.submit_load_task(keys, objs)), L)
        adapter.submit_unlock(keys)
        assert not adapter._leases
        return got

    try:
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        assert lookup_then(lambda: reg.register(tmp_path / "new")) == [None] * len(keys)
        shutil.copytree(tmp_path / "new", tmp_path / "new-copy")
        assert lookup_then(lambda: reg.register(tmp_path / "new-copy")) == ["new"] * len(keys)
    finally:
        adapter.close()


def test_a_read_that_never_returns_is_answered_as_a_miss_and_never_writes_l1_after(tmp_path, monkeypatch):
    """A load's read blocks (the cartridge's file on a disk or network filesystem that stopped
    answering; that cannot be caused here without root, so the origin's read waits on an event).
    The server's prefetch controller has no deadline of its own and vLLM asks again each step: on
    one reader thread every later lookup and load, any request's, would wait for ever. Here the
    stuck load is answered as a miss within `read_stall_seconds`; a lookup and a load submitted
    meanwhile are answered on a fresh thread (the load with the exact bytes); when the read comes
    back, the answered load writes nothing into its object (the server may have reused that L1
    memory); `close` returns while a read is stuck; no lookup lock is left."""
    from lmcache_cartridge.store.origins import LocalOrigin

    hasher, keys, kvs, (L, H, D) = _versions(tmp_path, ("doc",), chunks=2)
    reg = Registry(tmp_path / "reg.db")
    reg.register(tmp_path / "doc")
    stall = 0.5
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 3600, "read_stall_seconds": stall})
    desc = {0: MemoryLayoutDesc([torch.Size([2, L, CHUNK, H * D])], [torch.bfloat16])}
    entered, unstick, stuck_reads = threading.Event(), threading.Event(), []
    read = LocalOrigin.read_into

    def read_into(self, info, buf):
        if stuck_reads:  # the next read blocks until released
            stuck_reads.pop()
            entered.set()
            assert unstick.wait(60), "the test never released the stuck read"
        read(self, info, buf)

    monkeypatch.setattr(LocalOrigin, "read_into", read_into)

    def objects():
        return [SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H * D, dtype=torch.bfloat16)) for _ in keys]

    try:
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        stuck_reads.append(1)
        stuck = objects()
        answer = _wait(adapter, "load", adapter.submit_load_task(keys, stuck))
        assert entered.is_set() and answer.popcount() == 0, "the stuck load was expected to be answered as a miss"
        assert adapter._reader.answered_late == 1

        # the read is still stuck: a lookup and a load go on without it
        assert _wait(adapter, "lookup", adapter.submit_lookup_and_lock_task(keys, desc)).popcount() == len(keys)
        fresh = objects()
        assert _whose(kvs, fresh, _wait(adapter, "load", adapter.submit_load_task(keys, fresh)), L) == ["doc"] * 2
        adapter.submit_unlock(keys)
        assert not adapter._leases

        unstick.set()  # the filesystem answers again: the stuck thread finishes its read
        deadline = time.monotonic() + 30
        while adapter._reader.stuck() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert adapter._reader.stuck() == 0
        assert all(not o.tensor.any() for o in stuck), "an answered load wrote into the server's L1 object"

        # a read stuck while the server stops: `close` answers it and returns
        entered.clear()
        unstick.clear()
        stuck_reads.append(1)
        tid = adapter.submit_load_task(keys, objects())
        assert entered.wait(10)
        closer = threading.Thread(target=adapter.close)
        closer.start()
        closer.join(10)
        assert not closer.is_alive(), "close waited for a read that never returns"
        assert adapter.query_load_result(tid).popcount() == 0
    finally:
        unstick.set()
        adapter.close()


def test_a_cartridge_larger_than_what_l1_eviction_leaves_free_is_warned_of(tmp_path, caplog):
    """LMCache evicts from L1 only above its trigger watermark, and a load reserves all of its
    chunks at once: a cartridge larger than (1 - watermark) of L1 fails to load for as long as L1
    sits just under the watermark (seen with a real server: 2 objects of 256 KiB short by one in a
    1.2 MiB L1 at 61% used, until the request's deadline). The watcher warns of such a cartridge,
    naming the server settings that fix it, once, and not of one that fits; the figures are the
    server's own (`report_status`)."""
    import logging

    reg = Registry(tmp_path / "reg.db")
    for name, chunks, first in (("big", 4, 1000), ("small", 1, 5000)):
        pack_kv(random_kv(2, chunks * CHUNK, 2, 16, seed=chunks), tmp_path / name, cartridge_id=name, model=MODEL,
                kind="first_k", token_ids=list(range(first, first + chunks * CHUNK)), chunk_size=CHUNK)
        reg.register(tmp_path / name)
    big, small = (Manifest.load(tmp_path / name).payload_nbytes for name in ("big", "small"))
    capacity = 6 * small  # 20% free: the small one fits, the big one (4x) does not
    status = {"l1_capacity_bytes_by_backend": {"cpu": capacity},
              "l1_eviction_controllers": {"default": {"trigger_watermark": 0.8}}}
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache"),
                                  "refresh_seconds": 3600})
    try:
        adapter.attach(SimpleNamespace(token_hasher=TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor"),
                                       chunk_size=CHUNK, storage_manager=SimpleNamespace(report_status=lambda: status)))
        adapter.refresh()
        with caplog.at_level(logging.WARNING, logger="lmcache_cartridge.mp_adapter"):
            adapter._check_l1_room()
            adapter._check_l1_room()
        warned = [r.getMessage() for r in caplog.records if "per load" in r.getMessage()]
        assert len(warned) == 1 and "'big'" in warned[0] and "--l1-size-gb" in warned[0], warned
        assert f"{big / 2**20:.3g} MiB" in warned[0]
    finally:
        adapter.close()
