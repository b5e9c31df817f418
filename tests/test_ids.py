"""One rule turns names into cartridge ids (`manifest.id_from_name`), and what it returns is an id
`validate_id` accepts, whichever caller asks: input readers, registration, the CLI and `train`."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_cartridge.cartridge.inputs import trainable_cache
from lmcache_cartridge.cartridge.manifest import id_from_name, validate_id
from lmcache_cartridge.errors import ManifestError
from lmcache_cartridge.tools.selfstudy.config import TrainConfig

AWKWARD = ["_doc", "../x", "a b", "", "x" * 300, "_" * 300, "..", "-._", "é文档", "a" * 79 + "-b", "_run-step64"]


@pytest.mark.parametrize("name", AWKWARD)
@pytest.mark.parametrize("digest", [None, "0123456789abcdef" * 4])
def test_every_name_gives_a_valid_id(name, digest):
    cid = id_from_name(name, digest)
    assert validate_id(cid) == cid
    assert len(cid) <= 128
    if digest:
        assert cid.endswith("-" + digest[:12])


def test_ordinary_names_keep_their_ids():
    assert id_from_name("my-doc.v2") == "my-doc.v2"
    assert id_from_name("_doc") == "doc" and id_from_name("../x") == "x" and id_from_name("a b") == "a-b"
    assert id_from_name("") == "cartridge" and id_from_name("", fallback=None) is None
    assert id_from_name("x" * 300) == "x" * 80


def test_input_readers_suggest_valid_ids(tmp_path):
    run = tmp_path / "_run"
    run.mkdir()
    assert trainable_cache.suggested_id(run / "cache-step64.pt") == "run-step64"


@pytest.mark.parametrize("bad", ["../escape", "_doc", "a b", "x" * 300])
def test_train_refuses_a_bad_id_before_any_work(tmp_path, bad):
    from lmcache_cartridge.tools.selfstudy.run import run_id, train_cartridge

    with pytest.raises(ManifestError, match="invalid cartridge id"):
        run_id(TrainConfig(model_dir=tmp_path, text_path=tmp_path / "doc.txt", output=tmp_path / "o", cartridge_id=bad))
    # no model, no document: the id is refused before either is looked at
    cfg = TrainConfig(model_dir=tmp_path / "no-model", text_path=tmp_path / "no-doc.txt",
                      output=tmp_path / "out", cartridge_id=bad)
    with pytest.raises(ManifestError, match="invalid cartridge id"):
        train_cartridge(cfg)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.train").exists()


def test_train_names_its_cartridge_after_the_output(tmp_path):
    from lmcache_cartridge.tools.selfstudy.run import run_id

    cfg = TrainConfig(model_dir=tmp_path, text_path=tmp_path / "d.txt", output=Path("carts") / "_my doc")
    assert run_id(cfg) == "my-doc"


@pytest.mark.parametrize("bad", ["doc\n", "doc\r\n", "\ndoc"])
def test_an_id_with_a_newline_is_refused(bad):
    """Python's `$` matches before a final newline: "doc\\n" passed the id rule and broke
    the request later. Bucket names and key segments likewise."""
    from lmcache_cartridge.store.s3 import parse_s3_uri

    with pytest.raises(ManifestError, match="invalid cartridge id"):
        validate_id(bad)
    with pytest.raises(ValueError, match="invalid bucket name"):
        parse_s3_uri("s3://bucket\n/prefix")
    with pytest.raises(ValueError, match="invalid prefix segment"):
        parse_s3_uri("s3://bucket/pre\n")
    with pytest.raises(ValueError, match="invalid prefix segment"):
        parse_s3_uri("s3://bucket/a\n/b")
