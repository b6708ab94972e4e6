"""The pure decisions of fetching an s3:// model (`rlfleet.launch.objectstore`): where it goes,
which objects may be written where, and what checksum an ETag gives. The fetch itself is
tested against a real S3 server in tests/servers/test_model_objectstore.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from rlfleet.launch import objectstore
from rlfleet.launch.objectstore import FetchError, Remote


def test_one_model_has_one_folder_however_its_uri_is_written() -> None:
    root = Path("/cache")
    same = {
        objectstore.cache_folder(root, u, None) for u in ("s3://b/m", "s3://b/m/", "s3://b/m//")
    }
    assert len(same) == 1
    assert objectstore.cache_folder(root, "s3://b/m", "http://other:7070") not in same
    assert objectstore.cache_folder(root, "s3://b/n", None) not in same


@pytest.mark.parametrize(
    "key",
    ["m/../../etc/passwd", "m/a/./b", "m//etc", "m/a\nb", "m/w.part", "m/.rlfleet-fetched.json"],
)
def test_an_object_that_could_land_outside_its_folder_or_on_the_fetchs_own_files_is_refused(
    key: str,
) -> None:
    with pytest.raises(FetchError, match="not a path inside"):
        objectstore.relative_path(key, "m/")


def test_an_object_path_is_its_key_less_the_prefix() -> None:
    assert objectstore.relative_path("m/tokenizer/vocab.json", "m/") == "tokenizer/vocab.json"


def test_an_etag_gives_the_md5_and_its_parts_or_a_refusal_naming_the_object() -> None:
    md5 = hashlib.md5(b"x").hexdigest()
    assert objectstore.expected_md5(Remote("k", "k", 1, f'"{md5}"')) == (md5, 0)
    assert objectstore.expected_md5(Remote("k", "k", 1, f"{md5.upper()}-3")) == (md5, 3)
    with pytest.raises(FetchError, match="'m/w': ETag"):
        objectstore.expected_md5(Remote("m/w", "w", 1, "kms-encrypted-opaque-tag"))


def test_a_multipart_md5_is_the_md5_of_its_parts_md5s(tmp_path: Path) -> None:
    data = bytes(range(256)) * 41  # 10,496 bytes: parts of 4,096, 4,096 and 2,304
    path = tmp_path / "f"
    path.write_bytes(data)
    parts = [data[i : i + 4096] for i in range(0, len(data), 4096)]
    want = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
    assert objectstore.file_md5(path, 3, 4096) == want
    assert objectstore.file_md5(path, 0, 0) == hashlib.md5(data).hexdigest()
