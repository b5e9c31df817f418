"""What a client (a key, a tenant's key, whoever wrote the files it names) can make the gateway do
to the registry, the cache dir and the other tenants: each test is a bypass a review reproduced
against a real gateway app (and moto on loopback for S3), and fails on the code before its fix."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lmcache_cartridge.api.gateway import create_app
from lmcache_cartridge.api.settings import Tenant
from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME
from lmcache_cartridge.store.registry import Registry
from test_gateway import CHUNK, _call, _cart, model_dir, recording_upstream, settings  # noqa: F401 (fixtures)

ACME, GLOBEX, OPERATOR = "acme-key-0123456789", "globex-key-0123456789", "operator-key-0123456789"


@pytest.fixture
def tenants(tmp_path, settings, recording_upstream):
    """A gateway with two tenants, each with its own local root and id globs, and an operator key."""
    url, seen = recording_upstream
    roots = {t: settings.local_roots[0] / t for t in ("acme", "globex")}
    for r in roots.values():
        r.mkdir()
    ts = (Tenant("acme", keys=(ACME,), ids=("acme-*",), local_roots=(roots["acme"],)),
          Tenant("globex", keys=(GLOBEX,), ids=("globex-*",), local_roots=(roots["globex"],)))
    app = create_app(dataclasses.replace(settings, upstream=url, api_keys=(OPERATOR,), tenants=ts,
                                         force_redownload_interval=3600))
    return {"app": app, "roots": roots, "seen": seen, "reg": Registry(settings.registry)}


def ask(env, key, *carts, prompt=(5,)):
    return _call(env["app"], "POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                 json={"prompt": list(prompt), "max_tokens": 1, "cartridges": list(carts)})


def local(path, **kw):
    return {"id": str(path), "source": "local", **kw}


def edit_manifest(directory: Path, **fields) -> None:
    d = json.loads((directory / MANIFEST_NAME).read_text())
    d.update(fields)
    (directory / MANIFEST_NAME).write_text(json.dumps(d))


def test_force_redownload_cannot_re_register_a_cartridge_under_another_tenants_id(tenants, model_dir):
    """A tenant registers its own directory, rewrites its manifest to claim another tenant's id,
    then asks for its own id with force_redownload: the re-registration replaced the victim's
    entry (labels kept) for every tenant and every restart. It passes the claim rules of a first
    registration now: the victim's id stays the victim's."""
    acme, globex = tenants["roots"]["acme"], tenants["roots"]["globex"]
    reg, seen = tenants["reg"], tenants["seen"]
    _cart(globex / "doc", "globex-doc", list(range(200, 264)), model_dir, seed=2)
    reg.register(globex / "doc", labels=["handbook"])
    _cart(acme / "mine", "acme-mine", list(range(100, 164)), model_dir, seed=1)
    assert ask(tenants, ACME, local(acme / "mine")).status_code == 200
    edit_manifest(acme / "mine", cartridge_id="globex-doc")
    r = ask(tenants, ACME, {"id": "acme-mine", "force_redownload": True})
    assert r.status_code in (403, 409), r.text
    victim = reg.get("globex-doc")
    assert victim.path == str((globex / "doc").resolve()) and victim.labels == ["handbook"]
    assert ask(tenants, GLOBEX, {"id": "handbook"}).status_code == 200
    assert seen[-1][1]["prompt"][:64] == list(range(200, 264))  # globex's own document
    # the operator's key: no tenant scope, still not another origin's id
    assert ask(tenants, OPERATOR, {"id": "acme-mine", "force_redownload": True}).status_code in (409, 429)
    assert reg.get("globex-doc").path == str((globex / "doc").resolve())


def test_a_directory_walk_is_bounded_by_entries_not_files(tmp_path, settings, recording_upstream):
    """A local input directory is walked (stat only) for its change signature: the walk counted
    files, so a tree of empty directories was walked whole on every request (100,200 of them cost
    5-8 s of the gateway's CPU each time). Every entry counts now: one past the bound is 400."""
    import lmcache_cartridge.api.resolver as resolver_mod

    MAX_LOCAL_ENTRIES = 4096  # the bound (resolver.MAX_LOCAL_ENTRIES, checked below)
    url, seen = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url))
    tree = settings.local_roots[0] / "tree"
    for i in range(MAX_LOCAL_ENTRIES // 64 + 1):  # 65 directories of 64 empty ones: no file at all
        for j in range(64):
            (tree / f"d{i}" / f"e{j}").mkdir(parents=True)
    r = _call(app, "POST", "/v1/completions", json={"prompt": [5], "max_tokens": 1, "cartridges": [local(tree)]})
    assert r.status_code == 400, r.text
    assert f"more than {MAX_LOCAL_ENTRIES} entries" in r.json()["error"]["message"], r.text
    assert seen == [] and resolver_mod.MAX_LOCAL_ENTRIES == MAX_LOCAL_ENTRIES


def test_the_resolution_cache_answers_each_tenant_as_a_first_resolution_would(
        tmp_path, settings, model_dir, recording_upstream, moto_server):
    """A path (or S3 prefix) both tenants may read, whose manifest claims an id only acme may
    name: acme's request registers it; globex's is 403 (the id is outside its own). The cache
    was keyed by the path alone, so once acme had registered it globex's 403 became 200 (and told
    globex that acme uses it)."""
    from s3_server import s3_client, upload_dir

    url, _ = recording_upstream
    shared = settings.local_roots[0] / "shared"
    _cart(shared / "doc", "acme-doc", list(range(100, 164)), model_dir, seed=1)
    c = s3_client(moto_server)
    _cart(tmp_path / "s3doc", "acme-s3doc", list(range(300, 364)), model_dir, seed=3)
    upload_dir(c, "gw-unit", "shared/s3doc", tmp_path / "s3doc")
    ts = (Tenant("acme", keys=(ACME,), ids=("acme-*",), local_roots=(shared,), s3_roots=("gw-unit/shared",)),
          Tenant("globex", keys=(GLOBEX,), ids=("globex-*",), local_roots=(shared,), s3_roots=("gw-unit/shared",)))
    env = {"app": create_app(dataclasses.replace(settings, upstream=url, tenants=ts,
                                                 s3={"endpoint_url": moto_server}))}
    for cart in (local(shared / "doc"), {"id": "s3://gw-unit/shared/s3doc"}):
        first = ask(env, GLOBEX, cart)
        assert first.status_code == 403, first.text  # the id the manifest claims is acme's
        assert ask(env, ACME, cart).status_code == 200
        again = ask(env, GLOBEX, cart)
        assert (again.status_code, again.json()) == (first.status_code, first.json())


def test_the_same_parts_after_other_tokens_are_another_composite(tmp_path, settings, model_dir, recording_upstream):
    """A trained cartridge after tokens vLLM computes is served as a composite whose keys are
    chained over those tokens. Its directory was named by the parts' bytes alone: the composite
    after other tokens found the first one's directory, registered the first one again, and its
    own never existed (its requests could not load). Each context has its own now, each served."""
    import torch

    from lmcache_cartridge.store.origins import load_registered
    from test_gateway import _trained

    url, seen = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url))
    allowed = settings.local_roots[0]
    _trained(allowed / "tr", "tr", model_dir)
    reg = Registry(settings.registry)
    wanted = []
    for name, start in (("sys-a", 100), ("sys-b", 200)):
        torch.save({"token_ids": list(range(start, start + CHUNK))}, allowed / f"{name}.pt")
        r = _call(app, "POST", "/v1/completions", json={"prompt": [5], "max_tokens": 1, "cartridges": [
            local(allowed / f"{name}.pt"), local(allowed / "tr")]})
        assert r.status_code == 200, r.text
        sent = seen[-1][1]
        assert sent["prompt"][:CHUNK] == list(range(start, start + CHUNK))
        (recipe,) = sent["kv_transfer_params"]["lmcache_cartridge.composites"]
        assert recipe["start"] == CHUNK
        comp = [e for e in reg.list() if e.id.startswith("composite-") and e.id not in wanted]
        assert len(comp) == 1, [e.id for e in reg.list()]
        m = load_registered(comp[0])  # what the plugin does before it serves it
        assert m.context_ids == list(range(start, start + CHUNK)) and m.cartridge_id == comp[0].id
        wanted.append(comp[0].id)
    assert len({Path(reg.get(i).path) for i in wanted}) == 2


def test_labels_in_a_tenants_manifest_claim_only_names_in_its_scope(tenants, model_dir):
    """A manifest's labels were merged into the shared registry whoever wrote it: a tenant's
    `prod-faq` (or another tenant's label) answered the operator's request for `prod-faq` with
    the tenant's cartridge. A registration for a tenant keeps only the labels its own ids'
    patterns match; the operator's keys and `register` keep every label, as before."""
    acme, globex = tenants["roots"]["acme"], tenants["roots"]["globex"]
    reg, seen = tenants["reg"], tenants["seen"]
    _cart(globex / "doc", "globex-doc", list(range(200, 264)), model_dir, seed=2)
    reg.register(globex / "doc", labels=["handbook"])
    _cart(acme / "doc", "acme-doc", list(range(100, 164)), model_dir, seed=1)
    edit_manifest(acme / "doc", labels=["demo", "prod-faq", "handbook", "acme-faq"])
    assert ask(tenants, ACME, local(acme / "doc")).status_code == 200
    assert reg.get("acme-doc").labels == ["acme-faq"]
    r = ask(tenants, OPERATOR, {"id": "prod-faq"})
    assert r.status_code == 404 and "no cartridge with id or label 'prod-faq'" in r.text, r.text
    assert ask(tenants, OPERATOR, {"id": "handbook"}).status_code == 200
    assert seen[-1][1]["prompt"][:64] == list(range(200, 264))  # globex's, not ambiguous, not acme's
    assert ask(tenants, ACME, {"id": "acme-faq"}).status_code == 200
    assert seen[-1][1]["prompt"][:64] == list(range(100, 164))
    # the operator's own registration of a manifest keeps its labels
    assert reg.register(acme / "doc").labels == ["acme-faq", "demo", "handbook", "prod-faq"]


def test_force_redownload_is_limited_per_origin_however_it_is_spelled(tmp_path, settings, model_dir,
                                                                    recording_upstream):
    """force_redownload makes every instance drop a cartridge and read its origin again: at most
    once per interval per cartridge. The limit was kept per spelling, so naming the id and then
    its path (or the path and then the id) forced it twice within a second."""
    import torch

    url, _ = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url, force_redownload_interval=3600))
    allowed = settings.local_roots[0]
    reg = Registry(settings.registry)
    for name, seed in (("doc", 1), ("doc2", 2)):
        _cart(allowed / name, name, list(range(100 * seed, 100 * seed + 64)), model_dir, seed=seed)
        reg.register(allowed / name)
    kv = torch.randn(2, 2, CHUNK, 2, 64).to(torch.bfloat16)
    torch.save({"token_ids": list(range(500, 500 + CHUNK)),
                "kv_cache": {f"layer_{i}": kv[:, i].permute(0, 2, 1, 3).contiguous() for i in range(2)}},
               allowed / "in.pt")
    env = {"app": app}
    converted = ask(env, OPERATOR, local(allowed / "in.pt"))
    assert converted.status_code == 200, converted.text
    in_id = next(e.id for e in reg.list() if e.id.startswith("in-"))
    for first, second, cid in ((("doc",), (allowed / "doc",), "doc"),
                               ((allowed / "doc2",), ("doc2",), "doc2"),
                               ((allowed / "in.pt",), (in_id,), in_id)):
        spell = [{"id": s, "force_redownload": True} if isinstance(s, str) else local(s, force_redownload=True)
                 for s in (*first, *second)]
        assert ask(env, OPERATOR, spell[0]).status_code == 200
        r = ask(env, OPERATOR, spell[1])
        assert r.status_code == 429 and 3000 < int(r.headers["Retry-After"]) <= 3600, (cid, r.text)
        assert reg.get(cid).epoch == 1, cid


def test_an_s3_object_the_converter_refuses_is_not_downloaded_again(tmp_path, settings, model_dir, moto_server,
                                                                  s3_proxy, recording_upstream):
    """An object that downloads but is not a cartridge is refused (400) and deleted from the
    cache dir; the refusal was not remembered, so every plain request downloaded it again (and a
    packed prefix of another model fetched its manifest again). It is answered from memory now
    (no S3 request) until force_redownload asks for the object again."""
    from s3_server import s3_client, upload_dir

    url, _ = recording_upstream
    c = s3_client(moto_server)
    c.create_bucket(Bucket="gw-unit")
    c.put_object(Bucket="gw-unit", Key="ok/junk.pt", Body=b"not a torch file at all" * 1000)
    _cart(tmp_path / "other", "other-model-doc", list(range(1, 65)), "another-model")
    upload_dir(c, "gw-unit", "ok/other", tmp_path / "other")
    app = create_app(dataclasses.replace(settings, upstream=url, s3={"endpoint_url": s3_proxy.endpoint_url},
                                         force_redownload_interval=3600))
    env = {"app": app}
    for uri in ("s3://gw-unit/ok/junk.pt", "s3://gw-unit/ok/other"):
        s3_proxy.reset()
        first = ask(env, OPERATOR, {"id": uri})
        assert first.status_code == 400, first.text
        assert s3_proxy.count("GET") >= 1
        s3_proxy.reset()
        for _ in range(3):
            again = ask(env, OPERATOR, {"id": uri})
            assert (again.status_code, again.json()) == (first.status_code, first.json())
        assert s3_proxy.count() == 0, (uri, s3_proxy.requests)
    forced = ask(env, OPERATOR, {"id": "s3://gw-unit/ok/junk.pt", "force_redownload": True})
    assert forced.status_code == 400 and s3_proxy.count("GET") >= 1


def deflated_bomb(path: Path, nbytes: int) -> Path:
    """What torch.save writes for `nbytes` zero bytes, with that storage record deflated: a file
    of about nbytes/1000 bytes that torch.load inflates whole (zip archives may compress records;
    torch.save never does)."""
    import zipfile

    import torch

    plain = path.with_suffix(".plain")
    torch.save(torch.zeros(nbytes, dtype=torch.uint8), plain)
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(path, "w", compresslevel=1) as zout:
        for info in zin.infolist():
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.compress_type = zipfile.ZIP_DEFLATED if info.filename.endswith("/data/0") else zipfile.ZIP_STORED
            with zin.open(info) as src, zout.open(out, "w", force_zip64=True) as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    plain.unlink()
    return path


def _peak_rss_growth(fn) -> int:
    """Bytes this process's peak resident memory grew by while `fn()` ran (Linux: the peak is
    reset first through /proc/self/clear_refs)."""
    def kib(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise AssertionError(field)

    Path("/proc/self/clear_refs").write_text("5")
    before = kib("VmRSS")
    fn()
    return (kib("VmHWM") - before) * 1024


def test_a_compressed_pt_is_refused_before_it_is_inflated(tmp_path, settings, moto_server, s3_proxy,
                                                         recording_upstream):
    """A .pt file is a zip archive; torch.load inflates a deflated storage record whole, before
    any size check could run: 128 KiB named by a local path or an S3 URI grew the gateway by
    128 MiB, on every request (the refusal was not remembered). Every record must be stored as
    torch.save stores it, and all of them within the file's size: checked on the archive's
    directory before torch reads a record; the refusal is remembered."""
    from s3_server import s3_client

    nbytes = 128 << 20
    bomb = deflated_bomb(settings.local_roots[0] / "bomb.pt", nbytes)
    assert bomb.stat().st_size < nbytes // 500
    c = s3_client(moto_server)
    c.create_bucket(Bucket="gw-unit")
    c.upload_file(str(bomb), "gw-unit", "ok/bomb.pt")
    url, seen = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url, s3={"endpoint_url": s3_proxy.endpoint_url}))
    env = {"app": app}
    for cart in (local(bomb), {"id": "s3://gw-unit/ok/bomb.pt"}):
        got = []
        grew = _peak_rss_growth(lambda: got.append(ask(env, OPERATOR, cart)))  # noqa: B023 (called here)
        r = got[0]
        assert r.status_code == 400 and "record is compressed" in r.json()["error"]["message"], r.text
        assert grew < nbytes // 4, f"{grew >> 20} MiB"
        conversions, gets = app.state.resolver.stats["conversions"], s3_proxy.count("GET")
        assert (ask(env, OPERATOR, cart).status_code, ask(env, OPERATOR, cart).json()) == (400, r.json())
        assert app.state.resolver.stats["conversions"] == conversions and s3_proxy.count("GET") == gets
    assert seen == []


def two_directory_bomb(path: Path, nbytes: int) -> Path:
    """`deflated_bomb` with a decoy central directory just before its end record, listing every
    record stored (at its compressed size), while the end record's offset still points at the
    real directory (records deflated). Python's zipfile finds the directory back from the end
    record (the decoy), torch's reader at the offset (the real one)."""
    import zipfile

    deflated_bomb(path, nbytes)
    data = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        start = z.start_dir
    end = data.rindex(b"PK\x05\x06")
    assert len(data) - end == 22, "a zip64 end record: the decoy below assumes the classic one"
    decoy, at = bytearray(data[start:end]), 0
    while at < len(decoy):
        decoy[at + 10:at + 12] = (0).to_bytes(2, "little")  # stored
        decoy[at + 24:at + 28] = decoy[at + 20:at + 24]     # uncompressed size = compressed size
        at += 46 + sum(int.from_bytes(decoy[at + i:at + i + 2], "little") for i in (28, 30, 32))
    eocd = bytearray(data[end:])
    eocd[12:16] = len(decoy).to_bytes(4, "little")
    path.write_bytes(data[:end] + bytes(decoy) + bytes(eocd))
    return path


def test_a_pt_whose_zip_readers_disagree_is_refused_before_torch_reads_it(tmp_path, settings,
                                                                         recording_upstream):
    """Two central directories: the check read Python zipfile's (every record stored, within
    the file's size) and passed, then torch's reader inflated the real one's deflated record
    whole (the gateway grew by the record's size before the size refusal). The archive is read
    as torch reads it, and one whose directory does not end at its end record is refused
    before torch reads a record."""
    import zipfile

    import torch

    nbytes = 64 << 20
    bomb = two_directory_bomb(settings.local_roots[0] / "bomb.pt", nbytes)
    with zipfile.ZipFile(bomb) as z:  # the zip's directory alone looks harmless
        assert all(i.compress_type == zipfile.ZIP_STORED and i.compress_size == i.file_size for i in z.infolist())
        assert sum(i.file_size for i in z.infolist()) < bomb.stat().st_size
    reader = torch._C.PyTorchFileReader(str(bomb))  # torch's own view: the deflated record, whole
    assert len(reader.get_record("data/0")) == nbytes
    del reader
    url, seen = recording_upstream
    env = {"app": create_app(dataclasses.replace(settings, upstream=url))}
    got = []
    grew = _peak_rss_growth(lambda: got.append(ask(env, OPERATOR, local(bomb))))
    assert grew < nbytes // 4, f"{grew >> 20} MiB"  # the record was never inflated
    assert got[0].status_code == 400 and "zip readers would read different records" in got[0].text, got[0].text
    assert seen == []


def test_a_pt_holding_more_records_than_it_declares_is_refused(tmp_path):
    """The end record's count was bounded (`MAX_RECORDS`), but Python's zipfile reads every
    record in the directory whatever the count says: a file declaring 7 records held a million
    (seconds and hundreds of MiB before a refusal). Exactly the declared records are read."""
    import zipfile

    import torch

    from lmcache_cartridge.cartridge.inputs.torchfile import safe_torch_load
    from lmcache_cartridge.errors import CartridgeFormatError

    path = tmp_path / "many.pt"
    torch.save({"k": torch.arange(8)}, path)
    with zipfile.ZipFile(path) as z:
        declared = len(z.infolist())
    with zipfile.ZipFile(path, "a") as z:
        for i in range(200):
            z.writestr(f"many/extra/{i}", b"")
    data = bytearray(path.read_bytes())
    end = data.rindex(b"PK\x05\x06")
    data[end + 8:end + 12] = declared.to_bytes(2, "little") * 2  # the count on this disk and in all
    path.write_bytes(bytes(data))
    with zipfile.ZipFile(path) as z:
        assert len(z.infolist()) == declared + 200  # zipfile reads them all
    with pytest.raises(CartridgeFormatError, match=f"more than the {declared} records it declares"):
        safe_torch_load(path)


def shared_references(path: Path, depth: int) -> Path:
    """`L = [L, L]`, `depth` times over a tensor: a pickle of a few KB whose tree has 2**depth
    leaves (torch's restricted unpickler builds it: lists and memo references only)."""
    import torch

    obj: object = [torch.zeros(1)]
    for _ in range(depth):
        obj = [obj, obj]
    torch.save(obj, path)
    return path


@pytest.mark.timeout(300)  # a walk of the tree (not of each container once) is 2**60 paths: it never ends
def test_a_pickle_of_shared_references_is_read_in_time_linear_in_the_file(tmp_path, settings, recording_upstream):
    """The loaded object was walked as a tree: 2 KB of shared references sixty deep pinned a
    worker thread for good (depth 20 took seconds). Every container is visited once; one
    referenced twice is refused with the reason, and the gateway answers the next request."""
    bomb = shared_references(settings.local_roots[0] / "shared.pt", 60)
    assert bomb.stat().st_size < 8192
    url, _ = recording_upstream
    env = {"app": create_app(dataclasses.replace(settings, upstream=url))}
    r = ask(env, OPERATOR, local(bomb))
    assert r.status_code == 400 and "referenced more than once" in r.text, r.text
    listed = _call(env["app"], "GET", "/v1/cartridges", headers={"Authorization": f"Bearer {OPERATOR}"})
    assert listed.status_code == 200, listed.text


@pytest.mark.timeout(300)
def test_cartridge_work_cannot_take_the_threads_the_rest_of_the_gateway_needs(tmp_path, settings, moto_server,
                                                                            s3_proxy, recording_upstream):
    """Resolutions ran on the event loop's default thread pool (a handful of threads on a small
    machine): clients naming inputs that take long (here S3 objects whose origin stalls) took
    every thread, and `GET /v1/cartridges` waited with them. Cartridge work has its own pool."""
    import asyncio

    import httpx

    from lmcache_cartridge.api.gateway import CARTRIDGE_THREADS
    from s3_server import s3_client

    s3_client(moto_server).create_bucket(Bucket="gw-unit")
    stall = s3_proxy.inject(path=r"/gw-unit/ok/stall-", delay=3600)
    url, _ = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url, s3={"endpoint_url": s3_proxy.endpoint_url,
                                                                     "max_attempts": "1"}))
    auth = {"Authorization": f"Bearer {OPERATOR}"}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                     timeout=None) as c:
            stalled = [asyncio.create_task(c.post("/v1/completions", headers=auth, json={
                "prompt": [5], "max_tokens": 1, "cartridges": [{"id": f"s3://gw-unit/ok/stall-{i}.pt"}]}))
                for i in range(4 * CARTRIDGE_THREADS)]
            for _ in range(400):  # until the stalled origin holds as many as the gateway will send it
                if stall.hits >= CARTRIDGE_THREADS:
                    break
                await asyncio.sleep(0.05)
            try:
                listed = await asyncio.wait_for(c.get("/v1/cartridges", headers=auth), 60)
            except asyncio.TimeoutError:
                listed = None
            finally:
                s3_proxy.clear_faults()
            answers = await asyncio.gather(*stalled)
            return listed, answers

    listed, answers = asyncio.run(go())
    assert listed is not None and listed.status_code == 200, "GET /v1/cartridges waited for the stalled resolutions"
    assert {a.status_code for a in answers} == {404}, {a.status_code for a in answers}


@pytest.mark.timeout(300)
def test_a_name_flipped_to_another_tenants_file_after_the_check_is_never_read(settings):
    """The allow check resolved the named path once and the reads looked the name up again: a
    tenant flipping a name between its own file and a symlink to another tenant's file got the
    other's token ids now and then. The file checked is opened once, beneath the tenant's root
    without following a symlink, and read through that descriptor: each try answers the
    tenant's own ids or a refusal, never the other's."""
    import os
    import sys
    import threading
    from collections import Counter

    import torch

    from lmcache_cartridge.api.requests import CartridgeSpec
    from lmcache_cartridge.api.resolver import Resolver
    from lmcache_cartridge.api.settings import RequestError

    acme, globex = settings.local_roots[0] / "acme", settings.local_roots[0] / "globex"
    acme.mkdir()
    globex.mkdir()
    torch.save({"token_ids": list(range(10, 20))}, acme / "mine.pt")
    torch.save({"token_ids": list(range(900, 910))}, globex / "secret.pt")
    tenant = Tenant("acme", keys=(ACME,), ids=("acme-*",), local_roots=(acme,))
    r = Resolver(settings, Registry(settings.registry))
    name, stop = acme / "x.pt", threading.Event()

    def flip():
        i = 0
        while not stop.is_set():
            tmp = acme / f".flip{i}"
            if i % 2:
                os.symlink(globex / "secret.pt", tmp)
            else:
                os.link(acme / "mine.pt", tmp)
            os.replace(tmp, name)
            i += 1

    os.link(acme / "mine.pt", name)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the two threads as finely as the interpreter allows
    flipper = threading.Thread(target=flip)
    flipper.start()
    got: Counter = Counter()
    try:
        for _ in range(600):
            r._cache.clear()
            r._refused.clear()
            try:
                got["ids", r.resolve(CartridgeSpec(id=str(name), source="local"), tenant).token_ids[0]] += 1
            except RequestError as e:
                got["refused", e.status] += 1
    finally:
        stop.set()
        flipper.join()
        sys.setswitchinterval(interval)
    assert got["ids", 900] == 0, got
    assert got["ids", 10] > 0 and set(got) <= {("ids", 10), ("refused", 400), ("refused", 403)}, got


def test_the_cartridge_list_is_each_tenants_own(tenants, model_dir):
    """GET /v1/cartridges with a tenant's key lists only the ids it may name, with their labels:
    another tenant's entries (their ids, labels, directories, sources) appear nowhere in it. The
    operator's key lists every registered id."""
    acme, globex = tenants["roots"]["acme"], tenants["roots"]["globex"]
    reg = tenants["reg"]
    _cart(globex / "doc", "globex-doc", list(range(200, 264)), model_dir, seed=2)
    reg.register(globex / "doc", labels=["handbook", "globex-secret-label"])
    _cart(acme / "doc", "acme-doc", list(range(100, 132)), model_dir, seed=1)
    reg.register(acme / "doc", labels=["handbook"])

    def listed(key):
        r = _call(tenants["app"], "GET", "/v1/cartridges", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r

    r = listed(ACME)
    assert r.json() == {"object": "list", "data": [{"id": "acme-doc", "object": "cartridge", "labels": ["handbook"],
                                                    "model": model_dir, "tokens": 32, "kind": "first_k"}],
                        "first_id": "acme-doc", "last_id": "acme-doc", "has_more": False}
    assert "globex" not in r.text and str(acme) not in r.text
    assert [c["id"] for c in listed(GLOBEX).json()["data"]] == ["globex-doc"]
    assert "acme" not in listed(GLOBEX).text
    assert [c["id"] for c in listed(OPERATOR).json()["data"]] == ["acme-doc", "globex-doc"]
    assert _call(tenants["app"], "GET", "/v1/cartridges").status_code == 401


def test_the_refusal_table_has_no_row_an_earlier_row_hides():
    """`REFUSALS` answers by the first row a failure is an instance of: a row below one of its
    bases would never be reached (its status silently the base's)."""
    from lmcache_cartridge.api.resolver import REFUSALS

    for i, (kind, _, _) in enumerate(REFUSALS):
        hidden_by = [k for k, _, _ in REFUSALS[:i] if issubclass(kind, k)]
        assert not hidden_by, (kind, hidden_by)


def test_s3_failures_are_answered_by_the_one_refusal_table(tmp_path, settings, moto_server, s3_proxy,
                                                           recording_upstream):
    """Each way the object store fails a client's cartridge, through the real gateway and moto:
    a missing object 404, a denied one 403, one over `max_object_bytes` 413, a store that keeps
    failing 502 naming the URI (the store failed, not the client); the words are the store's own,
    in the OpenAI error shape."""
    from s3_server import s3_client

    from lmcache_cartridge.api.resolver import REFUSALS
    from lmcache_cartridge.store.s3 import AccessDenied, NotFound, OriginError, TooLarge

    url, _ = recording_upstream
    c = s3_client(moto_server)
    c.create_bucket(Bucket="gw-unit")
    for name in ("denied", "big", "down"):
        c.put_object(Bucket="gw-unit", Key=f"ok/{name}.pt", Body=b"x" * 4096)
    s3_proxy.inject(path=r"/gw-unit/ok/denied\.pt", status=403)
    s3_proxy.inject(path=r"/gw-unit/ok/down\.pt", status=400, code="InvalidRequest")
    app = create_app(dataclasses.replace(settings, upstream=url, s3={"endpoint_url": s3_proxy.endpoint_url,
                                                                     "max_object_bytes": 1024, "max_attempts": 1}))
    env = {"app": app}
    status = {kind: st for kind, st, _ in REFUSALS}
    for name, kind, words in (("missing", NotFound, "missing.pt"), ("denied", AccessDenied, "denied.pt"),
                              ("big", TooLarge, "1024"), ("down", OriginError, "cannot fetch s3://gw-unit/ok/down.pt")):
        r = ask(env, OPERATOR, {"id": f"s3://gw-unit/ok/{name}.pt"})
        body = r.json()["error"]
        assert (r.status_code, body["code"]) == (status[kind], status[kind]), (name, r.text)
        assert words in body["message"], (name, body)
    assert [status[k] for k in (NotFound, AccessDenied, TooLarge, OriginError)] == [404, 403, 413, 502]
