"""Never stale: removal and re-registration are ordered against LMCache's write-back
(hits from a plugin are copied into LocalCPUBackend right after the plugin's read returns),
quarantine is sticky until the cartridge's bytes change, and lookup pins have a lease and are
never recorded by the scheduler-side instance.

Through LMCache's real `LMCacheEngine` / `StorageManager`; the plugin built by LMCache from YAML.
"""

import threading
import time

import pytest
import torch

from conftest import rehash_manifest, random_kv
from test_plugin import CHUNK, D, H, L, MODEL, carts, engine_for, flat, load_config, write_yaml  # noqa: F401
from lmcache_cartridge.cartridge.packed import pack_kv
from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
from lmcache_cartridge.store.registry import Registry

REFRESH = 0.1  # test_plugin.write_yaml's refresh_seconds


def corrupt_chunk_with_nan(directory, manifest, index):
    """NaN inside one chunk with a matching checksum (packed elsewhere, wrong): caught at first read."""
    import hashlib
    import json

    import blake3

    payload = bytearray((directory / "kv.bin").read_bytes())
    info = manifest.chunks[index]
    chunk = torch.frombuffer(payload, dtype=torch.bfloat16, offset=info.offset, count=info.nbytes // 2)
    chunk[17] = float("nan")
    (directory / "kv.bin").write_bytes(bytes(payload))
    m = json.loads((directory / "manifest.json").read_text())
    m["chunks"][index]["sha256"] = hashlib.sha256(payload[info.offset:info.offset + info.nbytes]).hexdigest()
    m["chunks"][index]["blake3"] = blake3.blake3(payload[info.offset:info.offset + info.nbytes]).hexdigest()
    (directory / "manifest.json").write_text(json.dumps(rehash_manifest(m)))


def _until(cond, timeout=60.0, step=0.02):  # a poll: over as soon as cond holds
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(step)
    return cond()


@pytest.fixture
def same_doc(tmp_path):
    """One document packed twice with different KV (same tokens, so the same LMCache keys)."""
    toks = list(range(7000, 7000 + 2 * CHUNK))
    kv1, kv2 = random_kv(L, 2 * CHUNK, H, D, seed=61), random_kv(L, 2 * CHUNK, H, D, seed=62)
    pack_kv(kv1, tmp_path / "v1", cartridge_id="doc", model=MODEL, kind="first_k", token_ids=toks, chunk_size=CHUNK)
    pack_kv(kv2, tmp_path / "v2", cartridge_id="doc", model=MODEL, kind="first_k", token_ids=toks, chunk_size=CHUNK)
    reg = Registry(tmp_path / "reg.db")
    reg.register(tmp_path / "v1")
    return tmp_path, reg, toks, kv1, kv2


def _change(how, tmp_path, reg_path):
    other = Registry(reg_path)  # another process's connection, as the CLI would have
    if how == "remove":
        other.remove("doc")
    else:
        other.register(tmp_path / "v2")


def _expect_after(how, eng, toks, kv2):
    if how == "remove":
        assert eng.engine.lookup(toks + [1]) == 0
        n, _ = eng.retrieve(toks + [1])
        assert n == 0
    else:
        n, got = eng.retrieve(toks + [1])
        assert n == 2 * CHUNK
        assert torch.equal(got[:, :, :n].view(torch.uint8), flat(kv2).view(torch.uint8))


def test_draining_chunk_written_back_after_removal_is_purged(same_doc):
    """A lookup pins the cartridge's chunks; the cartridge is removed; the pinned request's
    retrieve through StorageManager then gets the old (draining) bytes, and LMCache writes them
    back into LocalCPUBackend after the plugin's purge. One refresh period later no lookup may
    find them: the written-back copy would win every later lookup. (After a re-registration
    the key maps to the new bytes at once, so a pinned request gets those: see the concurrent
    test below for that case.)"""
    how = "remove"
    tmp_path, reg, toks, kv1, kv2 = same_doc
    with engine_for(tmp_path, reg.path) as eng:
        plugin, sm = eng.backend("cartridge"), eng.storage_manager
        keys = plugin.mapper.keys(toks)
        old = plugin._state.served["doc"]
        hits, where = sm.batched_contains(keys, pin=True)
        assert hits == 2 and list(where) == ["cartridge"]
        _change(how, tmp_path, reg.path)
        assert _until(lambda: plugin._state.served.get("doc") is not old)
        objs = sm.batched_get(keys, location="cartridge")  # the pinned request's retrieve
        assert all(o is not None for o in objs)
        assert torch.equal(objs[0].tensor, flat(kv1)[:, :, :CHUNK])  # what it was promised
        cpu = eng.backend("LocalCPUBackend")
        assert all(cpu.contains(k) for k in keys)  # LMCache wrote the old bytes back, for real
        for o in objs:
            o.ref_count_down()
        sm.batched_unpin(keys)
        # the watcher's next ticks purge them (a wait, not a sleep: a busy machine starves the watcher)
        assert _until(lambda: not any(cpu.contains(k) for k in keys), timeout=3 * REFRESH + 10)
        _expect_after(how, eng, toks, kv2)


@pytest.mark.parametrize("how", ["remove", "reregister"])
def test_concurrent_retrieves_during_removal_leave_no_old_bytes(same_doc, how):
    """Retrieves through StorageManager run on other threads while the cartridge is removed or
    re-registered; once that is done and one refresh period has passed, LMCache's CPU cache
    holds none of the old bytes and lookups answer the new truth."""
    tmp_path, reg, toks, kv1, kv2 = same_doc
    with engine_for(tmp_path, reg.path) as eng:
        plugin, sm = eng.backend("cartridge"), eng.storage_manager
        keys = plugin.mapper.keys(toks)
        old = plugin._state.served["doc"]
        stop = threading.Event()
        errors: list[BaseException] = []
        reads = [0]

        def reader():
            try:
                while not stop.is_set():
                    for o in sm.batched_get(keys, location="cartridge"):
                        if o is not None:
                            o.ref_count_down()
                    reads[0] += 1
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        _change(how, tmp_path, reg.path)
        assert _until(lambda: plugin._state.served.get("doc") is not old)
        time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join()
        assert not errors and reads[0] > 10
        cpu = eng.backend("LocalCPUBackend")

        old_chunks = [flat(kv1)[:, :, :CHUNK], flat(kv1)[:, :, CHUNK:]]

        def cached() -> list:
            """Copies of what LocalCPUBackend holds for the cartridge's keys now."""
            out = []
            for k in keys:
                obj = cpu.get_blocking(k)
                if obj is not None:
                    out.append(obj.tensor.clone())
                    obj.ref_count_down()
            return out

        def holds_old(tensors: list) -> bool:
            return any(torch.equal(t, old) for t in tensors for old in old_chunks)

        # the watcher's next ticks purge them (a wait, not a sleep: a busy machine starves the watcher)
        assert _until(lambda: not holds_old(cached()), timeout=3 * REFRESH + 10)
        left = cached()  # only the new bytes may be there (re-registration), and stay so
        assert not holds_old(left) and (not left or how == "reregister")
        _expect_after(how, eng, toks, kv2)
        assert not plugin._state.tombstones or _until(lambda: not plugin._state.tombstones)


def test_quarantine_is_sticky_until_the_bytes_change(carts):
    """A cartridge whose origin bytes are bad is quarantined; an unrelated registry change must
    not bring it back (else any change's next refresh re-opens the bad bytes); re-registering
    good bytes does."""
    (a, kv_a), tmp, reg = carts["a"], carts["dir"], carts["reg"]
    corrupt_chunk_with_nan(tmp / "a", a, 1)
    reg.register(tmp / "a")  # registered as its packer left it (its digests, so its id, changed)
    with engine_for(tmp, reg.path) as eng:
        plugin = eng.backend("cartridge")
        n, _ = eng.retrieve(a.token_ids + [1])
        assert n == 0 and "doc-a" not in plugin.served_now()
        assert "NaN" in plugin._state.skipped["doc-a"]
        c = pack_kv(random_kv(L, CHUNK, H, D, seed=71), tmp / "c", cartridge_id="unrelated", model=MODEL,
                    kind="first_k", token_ids=list(range(9000, 9000 + CHUNK)), chunk_size=CHUNK)
        Registry(reg.path).register(tmp / "c")
        assert _until(lambda: "unrelated" in plugin.served_now())
        time.sleep(3 * REFRESH)
        assert "doc-a" not in plugin.served_now()
        assert eng.engine.lookup(a.token_ids + [1]) == 0
        assert eng.engine.lookup(c.token_ids + [1]) == CHUNK
        # the operator repacks good bytes and registers them: served again
        pack_kv(kv_a, tmp / "a2", cartridge_id="doc-a", model=MODEL, kind="first_k",
                token_ids=a.token_ids, chunk_size=CHUNK)
        Registry(reg.path).register(tmp / "a2")
        assert _until(lambda: "doc-a" in plugin.served_now())
        eng.clear_local_cpu()
        n, got = eng.retrieve(a.token_ids + [1])
        assert n == 3 * CHUNK and torch.equal(got[:, :, :n], flat(kv_a)[:, :, :n])


def test_a_quarantine_during_a_refresh_survives_its_swap_and_the_next(carts):
    """A reader quarantines a bad cartridge while a refresh is building its new state (between
    its copy of the state and its swap): the swap must keep the quarantine, and so must the next
    refresh. The interleaving is made exact by reading the bad cartridge from inside the
    refresh's opening of an unrelated cartridge (a real retrieve through the engine)."""
    (a, _), tmp, reg = carts["a"], carts["dir"], carts["reg"]
    bad = pack_kv(random_kv(L, 2 * CHUNK, H, D, seed=91), tmp / "bad", cartridge_id="bad", model=MODEL,
                  kind="first_k", token_ids=list(range(20000, 20000 + 2 * CHUNK)), chunk_size=CHUNK)
    corrupt_chunk_with_nan(tmp / "bad", bad, 1)
    for j in range(2):
        pack_kv(random_kv(L, CHUNK, H, D, seed=80 + j), tmp / f"u{j}", cartridge_id=f"unrelated-{j}",
                model=MODEL, kind="first_k", token_ids=list(range(8000 + 500 * j, 8000 + 500 * j + CHUNK)),
                chunk_size=CHUNK)
    with engine_for(tmp, reg.path) as eng:
        plugin = eng.backend("cartridge")
        object.__setattr__(plugin.settings, "refresh_seconds", 3600.0)  # only our refreshes run
        other = Registry(reg.path)
        other.register(tmp / "bad")
        plugin.refresh()
        assert "bad" in plugin.served_now()
        opened, real_open = [], plugin._open

        def open_while_a_reader_quarantines(entry):
            if entry.id == "unrelated-0" and not opened:
                opened.append(entry.id)
                assert eng.retrieve(bad.token_ids + [1])[0] == 0  # refused: quarantined now
                assert "bad" in plugin._state.quarantined
            return real_open(entry)

        plugin._open = open_while_a_reader_quarantines
        other.register(tmp / "u0")
        assert plugin.refresh() and opened == ["unrelated-0"]
        assert "bad" not in plugin.served_now() and "bad" in plugin._state.quarantined
        other.register(tmp / "u1")  # one more unrelated change: the quarantine still holds
        assert plugin.refresh()
        served = plugin.served_now()
        assert "bad" not in served and {"unrelated-0", "unrelated-1", "doc-a"} <= set(served)
        assert eng.engine.lookup(bad.token_ids + [1]) == 0
        assert eng.engine.lookup(a.token_ids + [1]) == 3 * CHUNK
        with plugin._lock:
            st = plugin._state
            assert all(st.served.get(sv.entry.id) is sv for sv, _ in st.index.values())
            assert set(st.index) == {k for sv in st.served.values() for k in sv.keys}


def test_lookup_pins_expire_after_their_lease(carts):
    """A pin LMCache never releases must not hold the CPU-tier copy (and a retired cartridge's
    origin) forever: pins have a lease."""
    a = carts["a"][0]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        object.__setattr__(plugin.settings, "pin_lease_seconds", 0.3)
        keys = plugin.mapper.keys(a.token_ids)
        assert plugin.batched_contains(keys, pin=True) == 3
        assert plugin.pin_count(keys[0]) == 1 and plugin.residency.cpu._pins
        assert _until(lambda: plugin.pin_count(keys[0]) == 0, timeout=60)
        assert all(plugin.pin_count(k) == 0 for k in keys)
        assert not plugin.residency.cpu._pins
        assert not plugin.unpin(keys[0])  # a late unpin finds nothing: harmless


def test_a_late_unpin_of_an_expired_pin_leaves_a_newer_lookups_pin(carts):
    """LMCache unpins a pin after its lease expired, while a newer lookup holds a pin on the same
    key: the newer pin must stay (the late unpin must not release the newer lookup's pin)."""
    a = carts["a"][0]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        object.__setattr__(plugin.settings, "pin_lease_seconds", 0.3)
        keys = plugin.mapper.keys(a.token_ids)
        assert plugin.batched_contains(keys[:1], pin=True) == 1          # lookup 1
        assert _until(lambda: plugin.pin_count(keys[0]) == 0, timeout=60)  # its lease ran out
        assert plugin.batched_contains(keys[:1], pin=True) == 1          # lookup 2
        assert not plugin.unpin(keys[0])                                  # LMCache, late, for lookup 1
        assert plugin.pin_count(keys[0]) == 1 and plugin.residency.cpu._pins
        assert plugin.unpin(keys[0])                                      # lookup 2's own unpin
        assert plugin.pin_count(keys[0]) == 0 and not plugin.residency.cpu._pins


def test_scheduler_side_instance_records_no_pins(carts):
    """The scheduler-side instance (`local_cpu_backend=None`) answers lookups but never
    retrieves or unpins: pins recorded there would live forever."""
    cfg = load_config(write_yaml(carts["dir"], carts["reg"].path))
    from lmc_helpers import make_metadata

    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK, role="scheduler")
    plugin = CartridgeStoragePlugin(dst_device="cpu", config=cfg, metadata=md, local_cpu_backend=None, loop=None)
    try:
        keys = plugin.mapper.keys(carts["a"][0].token_ids)
        assert plugin.batched_contains(keys, pin=True) == 3
        assert plugin.pin_count(keys[0]) == 0 and not plugin._state.pins
        assert not plugin.residency.cpu._pins
    finally:
        plugin.close()


def test_unpin_cost_does_not_grow_with_other_pins(carts):
    """Unpin is O(1): it touches the key's own pins and a per-cartridge count, not every pin
    held. Checked structurally (no timing): the per-cartridge count is exact under many pins."""
    a = carts["a"][0]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        keys = plugin.mapper.keys(a.token_ids)
        for _ in range(200):
            assert plugin.batched_contains(keys, pin=True) == 3
        served = plugin._state.served["doc-a"]
        assert served.pins == 600
        for _ in range(200):
            for k in keys:
                assert plugin.unpin(k)
        assert served.pins == 0 and not plugin._state.pins and not plugin.residency.cpu._pins
