"""An s3:// model fetched from a real S3 server (versitygw) as a pod's init container
fetches it (`python -m rlfleet.launch.objectstore`): whole and checked against the store's
ETags, resumed after a kill, refused with the file named when its bytes are wrong, and not
fetched again once complete."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from object_store import ObjectStore

from rlfleet.launch import objectstore

pytestmark = pytest.mark.servers

BIG = 64 << 20  # several parts, and long enough on loopback to be stopped half-way
SMALL = 24  # the bytes of the model's two small files


@pytest.fixture(scope="module")
def model(object_store: ObjectStore, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model's files in the store under s3://models/tiny: one multipart, two small."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "model.safetensors").write_bytes(os.urandom(BIG))
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    object_store.upload(folder, "models", "tiny")
    return folder


def fetch(store: ObjectStore, cache: Path, env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "rlfleet.launch.objectstore", "s3://models/tiny"]
    command += ["--cache", str(cache), "--endpoint", store.endpoint]
    return subprocess.Popen(
        command,
        env=os.environ | store.credentials | (env or {}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(process: subprocess.Popen) -> tuple[int, dict | None, str]:
    out, err = process.communicate(timeout=120)
    return process.returncode, json.loads(out) if out.strip() else None, err


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith(".rlfleet") and p.suffix != ".lock"
    }


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def killed_half_way(store: ObjectStore, cache: Path) -> Path:
    """A fetch killed while the big file is half fetched: the store is paused once its
    part file has bytes, so that the fetch cannot finish it. Returns the part file."""
    process = fetch(store, cache)
    deadline = time.monotonic() + 60
    try:
        while not (parts := [p for p in cache.rglob("model.safetensors.*.part") if size(p)]):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no part file after 60 s"
            time.sleep(0.001)
        store.process.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        process.kill()
        process.wait(timeout=10)
    finally:
        store.process.send_signal(signal.SIGCONT)
    (part,) = parts
    assert 0 < part.stat().st_size < BIG
    return part


def test_a_model_is_fetched_whole_and_checked_then_never_again(
    object_store: ObjectStore, model: Path, tmp_path: Path
) -> None:
    code, done, err = finished(fetch(object_store, tmp_path))
    assert code == 0, err
    folder = objectstore.cache_folder(tmp_path, "s3://models/tiny", object_store.endpoint)
    assert done == {"folder": str(folder), "files": 3, "bytes_fetched": BIG + SMALL, "resumed": 0}
    assert digests(folder) == digests(model)
    # The pods that come after on the node find it complete: nothing crosses the network.
    code, again, err = finished(fetch(object_store, tmp_path))
    assert code == 0, err
    assert again is not None and again["bytes_fetched"] == 0


def test_a_killed_fetch_resumes_where_it_stopped(
    object_store: ObjectStore, model: Path, tmp_path: Path
) -> None:
    part = killed_half_way(object_store, tmp_path)
    left = part.stat().st_size
    code, done, err = finished(fetch(object_store, tmp_path))
    assert code == 0, err
    assert done is not None and done["resumed"] == left
    # The rest of it, and of the small files those done before the kill left (config.json,
    # listed first, was done and kept).
    assert done["bytes_fetched"] == BIG - left + len("{}")
    assert digests(Path(done["folder"])) == digests(model)
    assert not list(tmp_path.rglob("*.part"))


def test_bytes_that_do_not_match_the_stores_checksum_are_refused_naming_the_file(
    object_store: ObjectStore, model: Path, tmp_path: Path
) -> None:
    part = killed_half_way(object_store, tmp_path)
    with part.open("r+b") as f:  # a disk's error, or a cache tampered with, in what was kept
        f.seek(7)
        byte = f.read(1)
        f.seek(7)
        f.write(bytes([byte[0] ^ 0xFF]))
    code, _, err = finished(fetch(object_store, tmp_path))
    assert code == 1
    assert "'tiny/model.safetensors'" in err and "do not match the store's checksum" in err
    folder = part.parent
    assert not (folder / "model.safetensors").exists() and not part.exists()
    # The bad bytes are gone: the next try fetches the file whole, and it holds.
    code, done, err = finished(fetch(object_store, tmp_path))
    assert code == 0, err
    assert done is not None and done["resumed"] == 0
    assert digests(folder) == digests(model)


def test_wrong_keys_are_refused_by_the_store_and_nothing_is_kept(
    object_store: ObjectStore, model: Path, tmp_path: Path
) -> None:
    code, _, err = finished(fetch(object_store, tmp_path, {"AWS_SECRET_ACCESS_KEY": "wrong"}))
    assert code == 1 and "SignatureDoesNotMatch" in err
    assert digests(tmp_path) == {}
