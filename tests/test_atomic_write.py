"""`paths.atomic_write` / `atomic_open` / `atomic_dir`: the one way files and directories are
published. Each writer has a temp name of its own (two writers of one path never collide), the
bytes and the rename reach the disk, and a failed write leaves the old content and no temp."""

from __future__ import annotations

import os

import pytest
import torch

from lmcache_cartridge.paths import atomic_dir, atomic_open, atomic_write


def test_two_writers_of_one_checkpoint_do_not_collide(tmp_path, monkeypatch):
    """The self-study loop saved its checkpoint through `<name>.tmp`, one name for every writer:
    a second writer starting while the first was between its write and its rename truncated the
    first's temp file, renamed it into place, and the first writer's rename then failed
    (FileNotFoundError) or published the other's half-written bytes. Each writer now has its own."""
    from lmcache_cartridge.tools.selfstudy import loop

    path = tmp_path / "ckpt.pt"
    real_replace, nested = os.replace, []

    def replace(src, dst):
        if not nested:  # the second writer runs between the first's write and its rename
            nested.append(1)
            loop._atomic_save({"writer": 2}, path)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    loop._atomic_save({"writer": 1}, path)
    assert torch.load(path, weights_only=True) == {"writer": 1}  # the last rename's, whole
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temp file left


def test_atomic_write_syncs_the_file_and_its_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = atomic_write(tmp_path / "sub" / "state.json", '{"a": 1}')
    assert path.read_text() == '{"a": 1}' and (path.stat().st_mode & 0o777) == 0o644
    assert synced[-1] == str(tmp_path / "sub")  # the rename, after the bytes
    assert any(p.startswith(str(tmp_path / "sub" / ".state.json.")) for p in synced[:-1]), synced
    synced.clear()
    atomic_write(path, b"rewritten", durable=False)
    assert path.read_bytes() == b"rewritten" and synced == []


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = atomic_write(tmp_path / "f", b"old")
    with pytest.raises(RuntimeError):
        with atomic_open(path) as f:
            f.write(b"half")
            raise RuntimeError("writer died")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_atomic_dir_publishes_whole_replaces_or_keeps_the_first(tmp_path):
    target = tmp_path / "cart"
    with atomic_dir(target) as d:
        (d / "a").write_text("1")
        assert not target.exists()  # nothing under the real name until it is complete
    assert (target / "a").read_text() == "1" and (target.stat().st_mode & 0o777) == 0o755
    with atomic_dir(target) as d:  # another writer's: the first one stays (content-addressed dirs)
        (d / "a").write_text("2")
    assert (target / "a").read_text() == "1"
    with atomic_dir(target, replace=True) as d:
        (d / "b").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    with pytest.raises(RuntimeError):
        with atomic_dir(target, replace=True) as d:
            (d / "c").write_text("half")
            raise RuntimeError("writer died")
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["cart"]  # no temp or old directory left
