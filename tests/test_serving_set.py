"""One serving lifecycle for both modes (`lmcache.serving_set`).

The in-process storage plugin (built by LMCache's own loader from YAML, in a real
`LMCacheEngine`) and the MP-mode L2 adapter (attached to LMCache's own `TokenHasher`, as
`lmcache server` attaches it) follow ONE registry through one scenario: register, serve, replace
with the same bytes (kept: the very same served object), with the same bytes under a new epoch
(force_redownload: replaced), with other bytes (replaced), quarantine of a cartridge whose chunk
fails verification (sticky across an unrelated change, lifted by good bytes), removal. After
every step both are asked the same: what they serve (ids, content hashes, epochs), what they
refuse, what they quarantine, and, for the same token ids, how many leading chunks hit and
whose KV each loaded chunk is. Both answers must equal each other and the expected one, so a
broken shared rule (`same_bytes`, the quarantine's match, `spoils`) fails here as well as a
rule one mode follows and the other does not.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import yaml
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.multiprocess.token_hasher import TokenHasher

from conftest import random_kv
from lmc_helpers import Engine, make_metadata
from lmcache_cartridge.cartridge.manifest import PAYLOAD_NAME
from lmcache_cartridge.cartridge.packed import pack_kv
from lmcache_cartridge.lmcache.mp_adapter import CartridgeL2Adapter
from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
from lmcache_cartridge.store.registry import Registry
from test_plugin import load_config, write_yaml

L, H, D, CHUNK = 2, 2, 16, 64
MODEL = "tiny-test-model"
DOC, BAD, OTHER = list(range(100, 100 + 2 * CHUNK)), list(range(3000, 3000 + 2 * CHUNK)), \
    list(range(6000, 6000 + CHUNK))


def chunks(kv: torch.Tensor) -> list[torch.Tensor]:
    """A `[2, L, T, H, D]` KV as LMCache's `KV_2LTD` chunks (`[2, L, CHUNK, H*D]`)."""
    flat = kv.reshape(2, L, kv.shape[2], H * D)
    return [flat[:, :, i:i + CHUNK] for i in range(0, kv.shape[2], CHUNK)]


class InProcess:
    """The storage plugin as LMCache's `StorageManager` drives it: lookup, then a blocking get."""

    name = "in-process"

    def __init__(self, eng: Engine) -> None:
        self.eng = eng
        self.set = eng.backend("cartridge")
        assert isinstance(self.set, CartridgeStoragePlugin)

    def read(self, tokens, salt: str = "") -> tuple[int, list[torch.Tensor]]:
        """`salt`: of KV a client brought, as the gateway sends it (LMCache's key tag here)."""
        keys = self.set.mapper.keys(tokens, salt)
        hits = self.set.batched_contains(keys)
        got = []
        for obj in self.set.batched_get_blocking(keys):  # a prefix, None from the first miss on
            if obj is not None:
                got.append(obj.tensor.clone())
                obj.ref_count_down()
        return hits, got


class MultiProcess:
    """The L2 adapter as `lmcache server`'s controllers drive it: lookup and lock, load, unlock."""

    name = "mp"

    def __init__(self, adapter: CartridgeL2Adapter, hasher: TokenHasher) -> None:
        self.set, self.hasher = adapter, hasher
        self.desc = {0: MemoryLayoutDesc([torch.Size([2, L, CHUNK, H * D])], [torch.bfloat16])}

    def _wait(self, query, tid: int):
        deadline = time.time() + 30
        while time.time() < deadline:
            got = query(tid)
            if got is not None:
                return got
            time.sleep(0.005)
        raise TimeoutError(tid)

    def read(self, tokens, salt: str = "") -> tuple[int, list[torch.Tensor]]:
        """`salt`: of KV a client brought, as the gateway sends it (vLLM's cache_salt here)."""
        a = self.set
        keys = [ObjectKey(h, MODEL, ObjectKey.ComputeKVRank(1, 0, 1, 0), 0, salt)
                for h in self.hasher.compute_chunk_hashes(list(tokens))]
        hits = self._wait(a.query_lookup_and_lock_result, a.submit_lookup_and_lock_task(keys, self.desc))
        a.submit_unlock([k for i, k in enumerate(keys) if hits.test(i)])
        objs = [SimpleNamespace(tensor=torch.zeros(2, L, CHUNK, H * D, dtype=torch.bfloat16)) for _ in keys]
        loaded = self._wait(a.query_load_result, a.submit_load_task(keys, objs))
        n = loaded.count_leading_ones()  # the server loads a prefix into L1, as LMCache's get does
        return hits.count_leading_ones(), [o.tensor for o in objs[:n]]


@pytest.fixture
def modes(tmp_path):
    reg = Registry(tmp_path / "reg.db")
    path = write_yaml(tmp_path, reg.path)
    cfg = yaml.safe_load(path.read_text())
    cfg["extra_config"]["storage_plugin.cartridge.refresh_seconds"] = 3600  # only the test refreshes
    cfg["extra_config"]["storage_plugin.cartridge.cache_dir"] = str(tmp_path / "cache-in-process")
    path.write_text(yaml.safe_dump(cfg))
    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
    adapter = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(tmp_path / "cache-mp"),
                                  "refresh_seconds": 3600})
    try:
        hasher = TokenHasher(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
        adapter.attach(SimpleNamespace(token_hasher=hasher, chunk_size=CHUNK, storage_manager=None))
        with Engine(load_config(path), md) as eng:
            yield reg, [InProcess(eng), MultiProcess(adapter, hasher)]
    finally:
        adapter.close()


def test_both_modes_serve_the_same_through_one_lifecycle(tmp_path, modes):
    reg, both = modes
    kv = {name: random_kv(L, n * CHUNK, H, D, seed=s)
          for name, n, s in (("doc-v1", 2, 1), ("doc-v2", 2, 2), ("bad", 2, 3), ("other", 1, 4))}
    whose = {name: chunks(t) for name, t in kv.items()}
    m = {"doc-v1": pack_kv(kv["doc-v1"], tmp_path / "doc-v1", cartridge_id="doc", model=MODEL, kind="first_k",
                           token_ids=DOC, chunk_size=CHUNK),
         "doc-v2": pack_kv(kv["doc-v2"], tmp_path / "doc-v2", cartridge_id="doc", model=MODEL, kind="first_k",
                           token_ids=DOC, chunk_size=CHUNK),
         "bad": pack_kv(kv["bad"], tmp_path / "bad", cartridge_id="bad", model=MODEL, kind="first_k",
                        token_ids=BAD, chunk_size=CHUNK),
         "bad-fixed": pack_kv(kv["bad"], tmp_path / "bad-fixed", cartridge_id="bad", model=MODEL, kind="first_k",
                              token_ids=BAD, chunk_size=CHUNK),
         "other": pack_kv(kv["other"], tmp_path / "other", cartridge_id="other", model=MODEL, kind="first_k",
                          token_ids=OTHER, chunk_size=CHUNK)}

    def name_of(t: torch.Tensor, chunk: int) -> str:
        found = [n for n, cs in whose.items() if chunk < len(cs) and torch.equal(t.view(torch.uint8),
                                                                              cs[chunk].view(torch.uint8))]
        return found[0] if found else "unknown bytes"

    def observe(mode) -> dict:
        s = mode.set
        reads = {}
        for doc, tokens in (("doc", DOC), ("bad", BAD), ("other", OTHER)):
            hits, got = mode.read(tokens)
            reads[doc] = (hits, [name_of(t, i) for i, t in enumerate(got)])
        with s._lock:
            skipped, quarantined = sorted(s._state.skipped), sorted(s._state.quarantined)
        return {"served": s.served_now(), "skipped": skipped, "quarantined": quarantined, "reads": reads}

    def step(what: str, expect: dict, *, refreshed: bool = True) -> list[dict]:
        """Both modes refresh; each is observed; both must equal `expect` (and each other)."""
        seen = []
        for mode in both:
            assert mode.set.refresh() is refreshed, (what, mode.name)
            seen.append(observe(mode))
        for mode, got in zip(both, seen):
            assert got == expect, f"{what}: {mode.name} served {got}, expected {expect}"
        return seen

    def served(mode, cid):
        with mode.set._lock:
            return mode.set._state.served[cid]

    nothing = (0, [])
    # register -> served
    reg.register(tmp_path / "doc-v1")
    step("register", {"served": {"doc": [m["doc-v1"].content_hash, 0]}, "skipped": [], "quarantined": [],
                      "reads": {"doc": (2, ["doc-v1", "doc-v1"]), "bad": nothing, "other": nothing}})
    first = [served(mode, "doc") for mode in both]

    # the same bytes registered again: kept, the very object that served them
    reg.register(tmp_path / "doc-v1")
    step("same bytes", {"served": {"doc": [m["doc-v1"].content_hash, 0]}, "skipped": [], "quarantined": [],
                        "reads": {"doc": (2, ["doc-v1", "doc-v1"]), "bad": nothing, "other": nothing}})
    assert [served(mode, "doc") for mode in both] == first and \
        all(served(mode, "doc") is old for mode, old in zip(both, first)), "same bytes must keep what serves them"

    # force_redownload: the same bytes under a new epoch are opened again
    reg.register(tmp_path / "doc-v1", force_redownload=True)
    step("new epoch", {"served": {"doc": [m["doc-v1"].content_hash, 1]}, "skipped": [], "quarantined": [],
                       "reads": {"doc": (2, ["doc-v1", "doc-v1"]), "bad": nothing, "other": nothing}})
    assert not any(served(mode, "doc") is old for mode, old in zip(both, first))

    # other bytes for the same id (and the same tokens, so the same keys): replaced
    reg.register(tmp_path / "doc-v2")
    step("other bytes", {"served": {"doc": [m["doc-v2"].content_hash, 1]}, "skipped": [], "quarantined": [],
                         "reads": {"doc": (2, ["doc-v2", "doc-v2"]), "bad": nothing, "other": nothing}})

    # a cartridge whose second chunk's bytes were damaged at its (local) origin after registration
    reg.register(tmp_path / "bad")
    payload = tmp_path / "bad" / PAYLOAD_NAME
    raw = bytearray(payload.read_bytes())
    raw[m["bad"].chunks[1].offset + 100] ^= 0x40
    payload.write_bytes(bytes(raw))
    # both serve it until a read verifies the chunk: the lookup hits both chunks, the load reads
    # chunk 0, refuses chunk 1 and quarantines the cartridge, so nothing of it is served
    for mode in both:
        assert mode.set.refresh()
        assert "bad" in mode.set.served_now()
        assert mode.read(BAD) == (2, []), mode.name
    quarantined = {"served": {"doc": [m["doc-v2"].content_hash, 1]}, "skipped": ["bad"], "quarantined": ["bad"],
                   "reads": {"doc": (2, ["doc-v2", "doc-v2"]), "bad": nothing, "other": nothing}}
    step("quarantined", quarantined, refreshed=False)
    for mode in both:
        with mode.set._lock:
            assert "checksum mismatch" in mode.set._state.skipped["bad"], mode.name

    # an unrelated registry change does not bring it back
    reg.register(tmp_path / "other")
    step("unrelated change", {**quarantined, "served": {**quarantined["served"], "other": [m["other"].content_hash, 0]},
                              "reads": {**quarantined["reads"], "other": (1, ["other"])}})

    # good bytes registered for it: served again
    reg.register(tmp_path / "bad-fixed")
    step("good bytes", {"served": {"doc": [m["doc-v2"].content_hash, 1], "bad": [m["bad-fixed"].content_hash, 0],
                                   "other": [m["other"].content_hash, 0]},
                        "skipped": [], "quarantined": [],
                        "reads": {"doc": (2, ["doc-v2", "doc-v2"]), "bad": (2, ["bad", "bad"]),
                                  "other": (1, ["other"])}})

    # removed: nothing of them is served
    reg.remove("doc")
    step("one removed", {"served": {"bad": [m["bad-fixed"].content_hash, 0], "other": [m["other"].content_hash, 0]},
                         "skipped": [], "quarantined": [],
                         "reads": {"doc": nothing, "bad": (2, ["bad", "bad"]), "other": (1, ["other"])}})
    reg.remove("bad")
    reg.remove("other")
    step("all removed", {"served": {}, "skipped": [], "quarantined": [],
                         "reads": {"doc": nothing, "bad": nothing, "other": nothing}})


def test_both_modes_serve_the_operators_registration_of_bytes_a_client_brought(tmp_path, modes):
    """A client's first-k KV is keyed under its own salt (`Entry.salt`: LMCache's key tag
    in-process, vLLM's cache_salt in MP mode): both modes serve it to requests that name it and
    to no other. The operator then registers the very same bytes: no salt, the cartridge's keys
    are the prompt's own. A served cartridge is kept across a refresh only while it would serve
    the same bytes under the same keys: the plugin kept the tagged keys for ever (same content
    hash, path and epoch), so the operator's registration never served its prompt in-process."""
    reg, both = modes
    kv = random_kv(L, 2 * CHUNK, H, D, seed=7)
    pack_kv(kv, tmp_path / "handbook", cartridge_id="handbook", model=MODEL, kind="first_k", token_ids=DOC,
            chunk_size=CHUNK)
    salt = reg.register(tmp_path / "handbook", client=True).salt
    assert salt
    for mode in both:
        assert mode.set.refresh()
        assert mode.read(DOC) == (0, []), mode.name  # the prompt's own keys: not the client's KV
        assert mode.read(DOC, "another-salt") == (0, []), mode.name
        hits, got = mode.read(DOC, salt)
        assert hits == 2 and len(got) == 2, (mode.name, hits, len(got))
        assert all(torch.equal(t, c) for t, c in zip(got, chunks(kv))), mode.name
    assert not reg.register(tmp_path / "handbook").salt  # the operator's: the same bytes, untagged
    for mode in both:
        assert mode.set.refresh()
        hits, got = mode.read(DOC)
        assert hits == 2 and len(got) == 2, (mode.name, hits, len(got))
        assert all(torch.equal(t, c) for t, c in zip(got, chunks(kv))), mode.name
        assert mode.read(DOC, salt) == (0, []), mode.name  # the client's registration is gone


def test_both_watchers_run_every_step_each_period_whatever_one_raises(modes, caplog):
    """One watcher loop (`ServingSet._watch`) in both modes: each period runs the adapter's steps
    in turn, and a step that raises (a locked registry, an origin that fails) is logged while the
    steps after it still run, period after period."""
    _reg, sets = modes
    for mode in sets:
        _watch_three_periods(mode, caplog)


def _watch_three_periods(mode, caplog) -> None:
    import dataclasses
    import logging
    import threading

    s = mode.set
    ran, closed, saved = [], threading.Event(), (s._closed, s.settings)

    def boom():
        ran.append("boom")
        raise RuntimeError("the registry is locked")

    def later():
        ran.append("later")
        if ran.count("later") == 3:
            closed.set()

    s._watch_steps = lambda: [("a failing step", boom), ("a later step", later)]
    s._closed, s.settings = closed, dataclasses.replace(s.settings, refresh_seconds=0.01)
    try:
        with caplog.at_level(logging.WARNING):
            watcher = threading.Thread(target=s._watch, daemon=True)
            watcher.start()
            watcher.join(30)
        assert not watcher.is_alive(), mode.name
        assert ran == ["boom", "later"] * 3, (mode.name, ran)
        assert sum("a failing step failed: the registry is locked" in r.getMessage()
                   for r in caplog.records) >= 3, mode.name
    finally:
        s._closed, s.settings = saved
        del s._watch_steps
        caplog.clear()
