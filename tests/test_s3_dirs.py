"""`s3://bucket/prefix/` holding a maker's input DIRECTORY, not a packed cartridge: a PEFT
`CARTRIDGE` adapter (written by PEFT's own `save_pretrained`) and a Tokasaurus directory
(`cartridge.pt` + `config.yaml`, as Tokasaurus' fake-cartridge script writes it), on a real moto S3
behind the counting proxy. The gateway's resolver lists the prefix once, downloads the files the
local directory form reads, converts once; the packed KV equals the local directory's, bit for
bit. Requests are counted: a repeat makes none, a restarted gateway one LIST, force_redownload
fetches the files again, a changed object is noticed by its ETag."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cartridge_makers import make_peft_adapter, write_tokasaurus_dir
from conftest import random_kv
from lmcache_cartridge.api.gateway import GatewaySettings, RequestError
from lmcache_cartridge.api.requests import CartridgeSpec
from lmcache_cartridge.api.resolver import Resolver
from lmcache_cartridge.cartridge.formats import load_input
from lmcache_cartridge.cartridge.packed import PackedCartridge, pack_kv
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.tools.testmodel import ensure_test_model
from s3_server import s3_client, upload_dir

CHUNK = 32
BUCKET = "dirs-unit"


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_test_model())


@pytest.fixture
def setup(tmp_path, model_dir, moto_server, s3_proxy):
    settings = GatewaySettings(upstream="http://127.0.0.1:9", model=model_dir, tokenizer=model_dir,
                               registry=tmp_path / "reg.db", cache_dir=tmp_path / "cache", chunk_size=CHUNK,
                               s3_roots=(f"{BUCKET}/ok",), s3={"endpoint_url": s3_proxy.endpoint_url})
    client = s3_client(moto_server)
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return settings, client


def _peft(tmp_path, model_dir, seed):
    from lmcache_cartridge.cartridge.model_kv import load_model

    d = tmp_path / f"peft-{seed}"
    make_peft_adapter(load_model(model_dir)[0], d, num_virtual_tokens=2 * CHUNK, num_frozen_tokens=1, seed=seed)
    return d


def test_peft_adapter_prefix_is_listed_once_downloaded_once_and_converted_bit_for_bit(tmp_path, setup, model_dir,
                                                                                        moto_server, s3_proxy):
    settings, client = setup
    local = _peft(tmp_path, model_dir, seed=3)
    upload_dir(client, BUCKET, "ok/peft", local)
    client.put_object(Bucket=BUCKET, Key="ok/peft/README.md", Body=b"# a model card, not read")
    reg = Registry(settings.registry)
    r = Resolver(settings, reg)
    got = r.resolve(CartridgeSpec(id=f"s3://{BUCKET}/ok/peft/"))
    assert got.kind == "trained" and got.entry is not None
    want = load_input(local).kv                  # PEFT stores fp32; the engine serves the model's bf16
    packed = PackedCartridge(got.entry.path)
    assert want.dtype == torch.float32 and packed.manifest.dtype == "bfloat16"
    assert torch.equal(packed.load_kv(), want.to(torch.bfloat16))   # the adapter's values, cast as PEFT does
    assert packed.manifest.provenance["format"] == "peft"
    assert packed.manifest.provenance["converted_from_dtype"] == "float32"
    # one LIST, then HEAD + GET for the two files the adapter form reads (not the README)
    assert s3_proxy.count("GET", r"list-type=2") == 1
    assert s3_proxy.count("HEAD") == 2 and s3_proxy.count("GET", r"/adapter_") == 2
    assert s3_proxy.count("GET", r"README") == 0 and s3_proxy.count() == 5
    before = (reg.writes, dict(r.stats))
    s3_proxy.reset()
    for _ in range(3):  # the resolution cache: no S3 request, no registry write
        assert r.resolve(CartridgeSpec(id=f"s3://{BUCKET}/ok/peft")) == got
    assert s3_proxy.count() == 0 and (reg.writes, dict(r.stats)) == before
    # a restarted gateway: one LIST; the files are current in the cache dir (size and ETag)
    r2 = Resolver(settings, Registry(settings.registry))
    assert r2.resolve(CartridgeSpec(id=f"s3://{BUCKET}/ok/peft/")).entry.path == got.entry.path
    assert s3_proxy.count() == 1 and s3_proxy.count("GET", r"list-type=2") == 1
    # force_redownload: the files again, exactly once each
    s3_proxy.reset()
    forced = r.resolve(CartridgeSpec(id=f"s3://{BUCKET}/ok/peft/", force_redownload=True))
    assert s3_proxy.count("GET", r"/adapter_") == 2 and forced.entry.epoch == got.entry.epoch + 1
    # another adapter uploaded over it: its ETags differ, a fresh resolver downloads and converts it
    other = _peft(tmp_path, model_dir, seed=4)
    upload_dir(client, BUCKET, "ok/peft", other)
    s3_proxy.reset()
    new = Resolver(settings, Registry(settings.registry)).resolve(CartridgeSpec(id=f"s3://{BUCKET}/ok/peft/"))
    assert s3_proxy.count("GET", r"/adapter_model") == 1
    assert new.entry.id != got.entry.id and torch.equal(PackedCartridge(new.entry.path).load_kv(),
                                                        load_input(other).kv.to(torch.bfloat16))


def test_tokasaurus_dir_and_packed_prefix_and_junk(tmp_path, setup, model_dir, s3_proxy):
    settings, client = setup
    kv = random_kv(2, 2 * CHUNK, 2, 64, seed=9)
    local = write_tokasaurus_dir(tmp_path / "toka", kv, model=model_dir, num_fixed_tokens=1)
    upload_dir(client, BUCKET, "ok/toka", local)
    pack_kv(random_kv(2, 40, 2, 64, seed=2), tmp_path / "packed", cartridge_id="packed-one", model=model_dir,
            kind="first_k", token_ids=list(range(3, 43)), chunk_size=CHUNK)
    upload_dir(client, BUCKET, "ok/packed", tmp_path / "packed")
    client.put_object(Bucket=BUCKET, Key="ok/junk/notes.txt", Body=b"hello")
    r = Resolver(settings, Registry(settings.registry))
    toka = r.resolve(CartridgeSpec(id=f"s3://{BUCKET}/ok/toka/"))
    assert toka.kind == "trained" and torch.equal(PackedCartridge(toka.entry.path).load_kv(), kv)
    assert PackedCartridge(toka.entry.path).manifest.provenance["format"] == "tokasaurus"
    packed = r.resolve(CartridgeSpec(id=f"s3://{BUCKET}/ok/packed"))  # still a packed prefix: chunks stay in S3
    assert packed.entry.id == "packed-one" and packed.entry.source_uri == f"s3://{BUCKET}/ok/packed"
    for uri, status, needle in [(f"s3://{BUCKET}/ok/junk/", 400, "notes.txt"),
                                (f"s3://{BUCKET}/ok/nothing/", 404, "nothing there"),
                                (f"s3://{BUCKET}/elsewhere/", 403, "outside")]:
        with pytest.raises(RequestError) as e:
            r.resolve(CartridgeSpec(id=uri))
        assert e.value.status == status and needle in str(e.value), (uri, e.value)


def test_s3_dir_form_matches_local_dir_form(tmp_path, setup, model_dir):
    """One rule for both: the S3 prefix converts to the same packed cartridge (same content
    digest, same directory) as the same directory given as a local path."""
    settings, client = setup
    kv = random_kv(2, CHUNK, 2, 64, seed=11)
    local = write_tokasaurus_dir(tmp_path / "allowed" / "toka", kv, model=model_dir)
    upload_dir(client, BUCKET, "ok/toka2", local)
    settings = replace(settings, local_roots=(tmp_path / "allowed",))
    r = Resolver(settings, Registry(settings.registry))
    via_s3 = r.resolve(CartridgeSpec(id=f"s3://{BUCKET}/ok/toka2"))
    via_local = r.resolve(CartridgeSpec(id=str(local), source="local"))
    assert via_s3.entry.path == via_local.entry.path and via_s3.token_ids == via_local.token_ids


def test_cli_register_of_an_s3_peft_adapter_prefix_converts_it_once(tmp_path, setup, model_dir, s3_proxy, capsys,
                                                                     monkeypatch):
    """`lmcache-cartridge register s3://bucket/prefix` of a PEFT adapter directory (not a packed
    cartridge): downloaded and converted as the gateway does, the packed KV equal to the local
    directory's, registered; a second register downloads nothing. Without --model-dir: one clear
    error."""
    from lmcache_cartridge.tools import cli

    settings, client = setup
    monkeypatch.setenv("LMCACHE_CARTRIDGE_HOME", str(tmp_path / "home"))  # the CLI's default cache dir
    local = _peft(tmp_path, model_dir, seed=5)
    upload_dir(client, BUCKET, "ok/cli-peft", local)
    base = ["register", f"s3://{BUCKET}/ok/cli-peft", "--registry", str(tmp_path / "cli-reg.db"),
            "--s3-endpoint", s3_proxy.endpoint_url, "--chunk-size", str(CHUNK)]
    assert cli.main(base) == 2 and "--model-dir" in capsys.readouterr().err
    gets = lambda: s3_proxy.count("GET", r"/ok/cli-peft/[^?]+$")  # noqa: E731
    assert cli.main(base + ["--model-dir", model_dir]) == 0
    assert "converted" in capsys.readouterr().out and gets() >= 2
    (entry,) = Registry(tmp_path / "cli-reg.db").list()
    assert entry.kind == "trained" and entry.model == model_dir and entry.num_tokens == 2 * CHUNK
    expected = load_input(local).kv.to(PackedCartridge(entry.path).manifest.torch_dtype)
    assert torch.equal(PackedCartridge(entry.path).load_kv(), expected)
    before = gets()
    assert cli.main(base + ["--model-dir", model_dir]) == 0  # listed again, nothing downloaded
    assert gets() == before and len(Registry(tmp_path / "cli-reg.db").list()) == 1
