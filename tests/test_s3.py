"""S3 origin against a real S3 HTTP server (moto on loopback), through a counting/faulting proxy."""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import threading
import time
import traceback

import pytest
import torch

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.cartridge.buffers import as_bytes
from lmcache_cartridge.cartridge.packed import pack_kv
from lmcache_cartridge.store.s3 import (AccessDenied, NotFound, OriginError, S3Origin, S3Settings, Timeout, Unavailable,
                                        parse_s3_uri)
from s3_server import s3_client, upload_dir

BUCKET, PREFIX = "carts", "models/demo-1"
URI = f"s3://{BUCKET}/{PREFIX}"


@pytest.fixture(scope="module")
def cartridge(moto_server, tmp_path_factory):  # noqa: F811
    """A packed cartridge on disk and the same bytes uploaded under `URI`."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 600, 2, 64, generator=g).bfloat16()
    d = tmp_path_factory.mktemp("cart") / "demo-1"
    m = pack_kv(kv, d, cartridge_id="demo-1", model="test/model", kind="first_k",
                token_ids=list(range(600)), chunk_size=256)
    upload_dir(s3_client(moto_server), BUCKET, PREFIX, d)
    return d, m


def bucket(endpoint: str):
    """A client for `BUCKET`, created if this worker's moto has not got it yet (xdist may run a
    test without the module's `cartridge` fixture having run on the same worker)."""
    client = s3_client(endpoint)
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return client


def origin(endpoint: str, uri: str = URI, **kw) -> S3Origin:
    kw.setdefault("max_attempts", 3)
    kw.setdefault("read_timeout", 5.0)
    kw.setdefault("connect_timeout", 2.0)
    return S3Origin(uri, S3Settings(endpoint_url=endpoint, **kw))


def test_manifest_fetched_equals_local(cartridge, s3_proxy):  # noqa: F811
    d, m = cartridge
    with origin(s3_proxy.endpoint_url) as o:
        raw = o.get_manifest_bytes()
    assert raw == (d / "manifest.json").read_bytes()
    assert Manifest.from_dict(json.loads(raw)) == m
    assert s3_proxy.count("GET", r"/manifest\.json$") == 1
    assert o.stats["gets"] == 1 and o.stats["bytes"] == len(raw) and o.stats["retries"] == 0


def test_chunk_ranged_reads_match_local_and_sha(cartridge, s3_proxy):  # noqa: F811
    d, m = cartridge
    local = (d / "kv.bin").read_bytes()
    with origin(s3_proxy.endpoint_url) as o:
        for c in m.chunks:
            out = torch.empty(m.chunk_shape(c.num_tokens), dtype=torch.bfloat16)
            total = o.read_range_into("kv.bin", c.offset, as_bytes(out))
            got = bytes(as_bytes(out))
            assert total == len(local)
            assert got == local[c.offset:c.offset + c.nbytes]
            assert hashlib.sha256(got).hexdigest() == c.sha256
        # LMCache's MemoryObj.byte_array is a ctypes array: its memoryview has format '<B'.
        c = m.chunks[1]
        arr = (ctypes.c_ubyte * c.nbytes)()
        assert memoryview(arr).format == "<B"
        o.read_range_into("kv.bin", c.offset, memoryview(arr))
        assert hashlib.sha256(bytes(arr)).hexdigest() == c.sha256
        assert o.stats["gets"] == len(m.chunks) + 1
    ranges = [r.range for r in s3_proxy.requests if r.method == "GET"]
    assert ranges[: len(m.chunks)] == [f"bytes={c.offset}-{c.offset + c.nbytes - 1}" for c in m.chunks]


@pytest.mark.parametrize("part_size", [5 << 20, 8 << 20])
def test_whole_object_download_identical(moto_server, s3_proxy, tmp_path, part_size):  # noqa: F811
    """A `.pt` object as one object: boto3's transfer manager fetches it, the result is checked
    against the HEAD (size, MD5 ETag) and lands atomically; 12 MiB takes several ranged parts."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, generator=g).numpy().tobytes()
    bucket(moto_server).put_object(Bucket=BUCKET, Key="objects/big.pt", Body=data)
    dest = tmp_path / "sub" / "big.pt"
    with origin(s3_proxy.endpoint_url, f"s3://{BUCKET}/objects/big.pt", part_size=part_size, max_concurrency=4) as o:
        info = o.download_object(dest)
    assert dest.read_bytes() == data
    assert info.size == len(data) and info.sha256 == hashlib.sha256(data).hexdigest()
    assert info.etag.strip('"') == hashlib.md5(data).hexdigest()
    assert list(dest.parent.iterdir()) == [dest]  # no temp file left
    assert s3_proxy.count("GET", r"/big\.pt$") == math.ceil(len(data) / part_size)


@pytest.mark.parametrize("fault", [dict(status=500), dict(cut_after=1000)], ids=["500", "cut-body"])
def test_object_download_is_atomic_on_failure(moto_server, s3_proxy, tmp_path, fault):  # noqa: F811
    bucket(moto_server).put_object(Bucket=BUCKET, Key="objects/small.pt", Body=b"x" * 100_000)
    dest = tmp_path / "small.pt"
    dest.write_bytes(b"old")  # an existing file must survive a failed download untouched
    s3_proxy.inject(method="GET", path=r"/small\.pt$", **fault)
    with origin(s3_proxy.endpoint_url, f"s3://{BUCKET}/objects/small.pt", max_attempts=2) as o:
        with pytest.raises(OriginError) as ei:
            o.download_object(dest)
    assert f"s3://{BUCKET}/objects/small.pt" in str(ei.value)
    assert dest.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.pt"]


def test_not_found_names_the_uri(cartridge, s3_proxy):  # noqa: F811
    with origin(s3_proxy.endpoint_url, f"s3://{BUCKET}/models/missing") as o:
        with pytest.raises(NotFound, match=f"s3://{BUCKET}/models/missing/manifest.json"):
            o.get_manifest_bytes()
        with pytest.raises(NotFound, match=f"s3://{BUCKET}/models/missing/kv.bin"):
            o.head("kv.bin")
        with pytest.raises(NotFound, match="kv.bin"):
            o.read_range_into("kv.bin", 0, bytearray(10))
    with origin(s3_proxy.endpoint_url, "s3://no-such-bucket/x") as o:
        with pytest.raises(NotFound, match="bucket"):
            o.get_manifest_bytes()
    assert s3_proxy.count(status=404) == 4  # 404s are not retried


def test_access_denied_on_403(cartridge, s3_proxy):  # noqa: F811
    s3_proxy.inject(path=r"/kv\.bin$", status=403)
    with origin(s3_proxy.endpoint_url) as o:
        with pytest.raises(AccessDenied, match=f"{URI}/kv.bin"):
            o.read_range_into("kv.bin", 0, bytearray(10))
        with pytest.raises(AccessDenied):
            o.head("kv.bin")
        assert o.get_manifest_bytes()  # only kv.bin is denied
    assert s3_proxy.count(path=r"/kv\.bin$") == 2  # 403 is not retried


def test_503_retried_then_succeeds(cartridge, s3_proxy):  # noqa: F811
    d, m = cartridge
    fault = s3_proxy.inject(method="GET", path=r"/kv\.bin$", status=503, times=2)
    buf = bytearray(1000)
    with origin(s3_proxy.endpoint_url, max_attempts=3) as o:
        o.read_range_into("kv.bin", 5, buf)
        assert o.stats["retries"] == 2 and o.stats["gets"] == 1
    assert bytes(buf) == (d / "kv.bin").read_bytes()[5:1005]
    assert fault.hits == 2
    assert s3_proxy.count("GET", r"/kv\.bin$") == 3
    assert s3_proxy.count("GET", r"/kv\.bin$", status=503) == 2


def test_503_exhausted_is_unavailable(cartridge, s3_proxy):  # noqa: F811
    s3_proxy.inject(method="GET", path=r"/kv\.bin$", status=503)
    with origin(s3_proxy.endpoint_url, max_attempts=2) as o, pytest.raises(Unavailable, match="SlowDown"):
        o.read_range_into("kv.bin", 0, bytearray(10))
    assert s3_proxy.count("GET", r"/kv\.bin$") == 2


def test_cut_body_is_refetched(cartridge, s3_proxy):  # noqa: F811
    d, m = cartridge
    c = m.chunks[0]
    s3_proxy.inject(method="GET", path=r"/kv\.bin$", cut_after=1000, times=1)
    out = bytearray(c.nbytes)
    with origin(s3_proxy.endpoint_url) as o:
        o.read_range_into("kv.bin", c.offset, out)
        assert o.stats["retries"] == 1
    assert hashlib.sha256(out).hexdigest() == c.sha256
    assert s3_proxy.count("GET", r"/kv\.bin$") == 2


def test_timeout_is_unavailable_quickly(cartridge, s3_proxy):  # noqa: F811
    s3_proxy.inject(method="GET", path=r"/kv\.bin$", delay=10.0)
    with origin(s3_proxy.endpoint_url, read_timeout=0.3, max_attempts=2) as o:
        t0 = time.monotonic()  # the read alone, not the client's construction
        with pytest.raises(Timeout):
            o.read_range_into("kv.bin", 0, bytearray(10))
        took = time.monotonic() - t0
    assert took < 5, took  # 2 x 0.3 s plus one backoff (< 1 s), not 2 x 10 s
    assert issubclass(Timeout, Unavailable)


def test_connection_refused_is_unavailable(cartridge):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with origin(f"http://127.0.0.1:{port}", max_attempts=1) as o, pytest.raises(Unavailable):
        o.get_manifest_bytes()
    assert time.monotonic() - t0 < 3


def test_concurrent_reads_counted_at_server(cartridge, s3_proxy):  # noqa: F811
    _, m = cartridge
    with origin(s3_proxy.endpoint_url, max_concurrency=8) as o:
        bufs = [bytearray(m.chunks[0].nbytes) for _ in range(8)]
        ts = [threading.Thread(target=o.read_range_into, args=("kv.bin", 0, b)) for b in bufs]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert all(hashlib.sha256(b).hexdigest() == m.chunks[0].sha256 for b in bufs)
    assert s3_proxy.count("GET", r"/kv\.bin$") == 8


def test_secrets_never_in_error_text(cartridge, s3_proxy, monkeypatch):  # noqa: F811
    secret = "SeCrEt/Zq9Xv+DistinctSecretValue0042"
    token = "ToKeN-DistinctSessionToken-7731"
    key_id = "AKIADISTINCTKEYID77"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    errors: list[BaseException] = []

    def catch(fn) -> None:
        try:
            fn()
        except CartridgeError as e:
            errors.append(e)

    once = dict(read_timeout=10, max_attempts=1)  # a slow reply is still the reply the case is about
    o = origin(s3_proxy.endpoint_url, **once)
    impatient = origin(s3_proxy.endpoint_url, read_timeout=0.3, max_attempts=1)  # for the delay alone
    catch(lambda: origin(s3_proxy.endpoint_url, f"s3://{BUCKET}/nope", **once).get_manifest_bytes())
    s3_proxy.inject(path=r"/kv\.bin$", status=403, times=1)
    catch(lambda: o.read_range_into("kv.bin", 0, bytearray(10)))
    s3_proxy.inject(path=r"/kv\.bin$", status=503, times=1)
    catch(lambda: o.read_range_into("kv.bin", 0, bytearray(10)))
    s3_proxy.inject(path=r"/kv\.bin$", delay=10.0, times=1)
    catch(lambda: impatient.read_range_into("kv.bin", 0, bytearray(10)))
    s3_proxy.inject(path=r"/kv\.bin$", method="GET", status=412, code="PreconditionFailed", times=1)
    catch(lambda: o.read_range_into("kv.bin", 0, bytearray(10), if_match='"stale"'))  # object changed
    assert [type(e) for e in errors] == [NotFound, AccessDenied, Unavailable, Timeout, OriginError]
    try:
        S3Settings(endpoint_url=f"http://{key_id}:{secret}@127.0.0.1:1")
    except ValueError as e:
        errors.append(e)
    assert len(errors) == 6
    for e in errors:
        text = "".join(traceback.format_exception(e)) + repr(e) + repr(e.args)
        for s in (secret, token, key_id):
            assert s not in text
    assert secret not in repr(o) and secret not in repr(o.settings)


@pytest.mark.parametrize("uri,expect", [
    ("s3://carts/models/demo-1", ("carts", "models/demo-1")),
    ("s3://carts/models/demo-1/", ("carts", "models/demo-1")),
    ("s3://my.bucket-1/a/b=c/d_e.f", ("my.bucket-1", "a/b=c/d_e.f")),
    ("s3://carts", ("carts", "")),
    ("s3://carts/", ("carts", "")),
])
def test_parse_s3_uri_accepts(uri, expect):
    assert parse_s3_uri(uri) == expect


@pytest.mark.parametrize("uri", [
    "", "carts/x", "http://carts/x", "S3://carts/x", "s3://", "s3:///x", "s3://ab/x", "s3://Carts/x",
    "s3://-carts/x", "s3://carts-/x", "s3://car..ts/x", "s3://192.168.1.1/x", "s3://" + "a" * 64 + "/x",
    "s3://carts/a/../b", "s3://carts/..", "s3://carts/./a", "s3://carts/a//b", "s3://carts//a",
    "s3://carts/a b", "s3://carts/a?x=1", "s3://carts/a#f", "s3://carts/a%2e", "s3://carts/a\\b",
    "s3://carts/a\nb", "s3://user@carts/x", "s3://carts:9000/x", "s3://carts/ümlaut", None,
])
def test_parse_s3_uri_rejects(uri):
    with pytest.raises(ValueError):
        parse_s3_uri(uri)


def test_settings_from_mapping():
    s = S3Settings.from_mapping({
        "s3_endpoint_url": "http://127.0.0.1:9", "s3_region": "eu-west-1", "s3_max_attempts": "7",
        "s3_connect_timeout": "1.5", "s3_read_timeout": "2", "s3_max_concurrency": "3",
        "s3_part_size": "16MiB", "s3_retry_mode": "adaptive", "unrelated": "x",
    }, prefix="s3_")
    assert s == S3Settings(endpoint_url="http://127.0.0.1:9", region="eu-west-1", max_attempts=7,
                           connect_timeout=1.5, read_timeout=2.0, max_concurrency=3,
                           part_size=16 << 20, retry_mode="adaptive")
    assert S3Settings.from_mapping({"part_size": "512k"}).part_size == 512 << 10
    assert S3Settings.from_mapping({}) == S3Settings()
    for bad in ({"max_attempts": "zero"}, {"max_attempts": "0"}, {"part_size": "8 parsecs"},
                {"retry_mode": "legacy"}, {"read_timeout": "-1"}, {"endpoint_url": "ftp://x"}):
        with pytest.raises(CartridgeError):
            S3Settings.from_mapping(bad)
