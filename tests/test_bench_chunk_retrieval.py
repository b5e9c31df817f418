"""The chunk-retrieval benchmark's code paths return the packed chunk's bytes (tiny sizes, no timings).

Every arm of `benchmarks/chunk_retrieval.py` (`benchmarks/harness/tiers.py`): our tiers through
the plugin loaded by a real LMCacheEngine, each raw limit, and each LMCache built-in backend (LocalDiskBackend, fs
connector, S3 connector in a private mount namespace).
"""

import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import chunk_retrieval as cr  # noqa: E402  (the run: markdown, plot, LMCache's S3 arm in its namespace)
import harness.tiers as tiers  # noqa: E402  (the arms)
from harness import machine_info  # noqa: E402

SHAPE = tiers.Shape("unit", 2, 2, 16)  # 32 KiB chunks
N, N_S3 = 4, 2


@pytest.fixture(scope="module")
def ds(tmp_path_factory, moto_server):
    work = tmp_path_factory.mktemp("bench")
    d = tiers.build_dataset(SHAPE, N, N_S3, work, seed=3)
    tiers.upload_s3(d, moto_server)
    return d


def check(arm, indices):
    objs = arm.fetch(indices)
    try:
        assert len(objs) == len(indices)
        for i, o in zip(indices, objs):
            assert torch.equal(tiers.obj_bytes(o), arm.expected(i)), (arm.name, i)
            assert o.tensor.shape == SHAPE.lmc_shape and o.tensor.dtype == torch.bfloat16
    finally:
        arm.release(objs)


def test_expected_bytes_are_the_packed_chunks(ds):
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    with PackedCartridge(ds.local_dir) as p:
        for i in range(N):
            assert torch.equal(p.read_chunk(i).reshape(-1).view(torch.uint8), ds.expected(i))
            assert torch.equal(p.read_raw(i), ds.raw(i))
    for i in range(N_S3):
        with PackedCartridge(ds.s3_dirs[i]) as p:
            assert torch.equal(p.read_chunk(0).reshape(-1).view(torch.uint8), ds.expected_s3(i))
            assert torch.equal(p.read_raw(0), ds.raw_s3(i))


def test_our_tiers_and_the_limits(ds, tmp_path, moto_server):
    alloc = tiers.alloc_gb_for(SHAPE, N)
    host = tiers.PluginHost(ds, tmp_path, name="cpu", cpu_gb=0.01, disk_gb=0, alloc_gb=alloc)
    try:
        arm = tiers.OursArm(host, "cpu")
        arm.prepare()
        check(arm, list(range(N)))
        check(arm, [2, 0])
        assert host.plugin.metrics.tiers["cpu"].hits >= N + 2  # served by the plugin's CPU tier
        check(tiers.MemcpyLimit(ds, host.allocator), list(range(N)))
        check(tiers.MemmoveLimit(ds, host.allocator), list(range(N)))
        for cold in (False, True):
            lim = tiers.ReadLimit(ds, host.allocator, cold)
            lim.before_batch([0, 1])
            check(lim, [0, 1, 3])
            lim.close()
        check(tiers.Boto3Limit(ds, host.allocator, moto_server), list(range(N_S3)))
    finally:
        host.close()

    host = tiers.PluginHost(ds, tmp_path, name="disk", cpu_gb=0, disk_gb=0, alloc_gb=alloc)
    try:
        for tier in ("disk-warm", "disk-cold"):
            arm = tiers.OursArm(host, tier)
            arm.before_batch([0])
            check(arm, list(range(N)))
        assert not host.plugin.residency.cpu.keys()  # CPU tier off: every read hit the payload
        assert host.plugin.residency.origin_reads == 2 * N
    finally:
        host.close()

    host = tiers.PluginHost(ds, tmp_path, name="s3", cpu_gb=0, disk_gb=0, alloc_gb=alloc,
                         s3_endpoint=moto_server)
    try:
        arm = tiers.OursArm(host, "s3")
        check(arm, list(range(N_S3)))
        check(arm, [1])
        assert host.plugin.metrics.tiers["s3"].hits == N_S3 + 1  # every read was a GET
    finally:
        host.close()


@pytest.mark.parametrize("kind", ["localdisk", "fs"])
def test_lmcache_builtin_backends(ds, tmp_path, kind):
    host = tiers.LMCacheHost(ds, tmp_path, kind, tiers.alloc_gb_for(SHAPE, N))
    try:
        assert len(host.allocator.hot_cache) == 0  # served by the backend, not LocalCPUBackend
        for cold in (False, True):
            arm = tiers.LMCacheArm(host, cold)
            arm.before_batch([0])
            check(arm, list(range(N)))
            check(arm, [3])
    finally:
        host.close()


def test_lmcache_s3_connector_in_private_mount_namespace(ds, tmp_path, moto_server):
    port = int(moto_server.rsplit(":", 1)[1])
    res = cr.run_lmc_s3(ds, tmp_path, port, [1, N_S3], {1: 2, N_S3: 1}, tiers.alloc_gb_for(SHAPE, N),
                        timeout=120)
    err = res.get("error") or ""
    if err and any(s in err for s in ("Operation not permitted", "unshare: ", "not found")):
        pytest.skip(f"needs a private mount namespace: {err}")
    assert not err, err
    # each batch's first sample was compared byte for byte with the packed chunks in the child
    assert [r["batch"] for r in res["results"]] == [1, N_S3]
    assert all(r["verified"] for r in res["results"])


def test_measure_lookup_and_report(ds, tmp_path):
    host = tiers.PluginHost(ds, tmp_path, name="lookup", cpu_gb=0.01, disk_gb=0, alloc_gb=0.01)
    try:
        lk = tiers.measure_lookup(host.plugin, ds.token_ids, iters=3)
        assert lk["keys"] == N and lk["no_pin"]["us_per_key_median"] > 0
        assert all(host.plugin.pin_count(k) == 0 for k in host.keys)  # pins were released
        arm = tiers.OursArm(host, "cpu")
        r = tiers.measure(arm, 2, 2, SHAPE.chunk_bytes)
        assert r["verified"] and r["gbps"] > 0
    finally:
        host.close()
    report = {"mode": "test", "machine": machine_info(), "elapsed_s": 0.0, "lookup": lk,
              "shapes": [{"shape": asdict(SHAPE), "chunk_bytes": SHAPE.chunk_bytes, "batches": [2],
                          "s3_batches": [2], "arms": [{"arm": "ours-cpu", "kind": "ours", "tier": "cpu",
                                                       "results": [r]}]}]}
    md = cr.markdown(report)
    assert "| unit | cpu | 2 |" in md
    cr.plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
