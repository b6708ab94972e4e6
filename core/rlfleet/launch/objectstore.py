"""A model in object storage (`spec.model.uri` s3://BUCKET/PREFIX, any S3-compatible store),
fetched into a cache folder before a component reads it: every object under the prefix,
each checked against the store's MD5 ETag (a multipart object's too, part by part), and
resumed where a killed fetch stopped.

One folder per model (`cache_folder`: the endpoint and URI hashed), so that the pods of a
node that share a cache volume fetch it once: the first takes the folder's lock, the others
wait and find it done. A file is written as `NAME.<etag>.part` and renamed only once its
checksum holds, so a component never reads half a file, and a changed object is fetched
again rather than resumed from the old one's bytes."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from minio import Minio

S3_SCHEME = "s3://"
DEFAULT_ENDPOINT = "https://s3.amazonaws.com"
# What the fetch wrote last: the objects (path and ETag) the folder holds, all verified.
MANIFEST = ".rlfleet-fetched.json"
CHUNK = 1 << 20
# A single-part object's ETag is its MD5; a multipart one's the MD5 of its parts' MD5s and
# their count. Stores that encrypt with KMS keys give other ETags: those cannot be checked.
_ETAG = re.compile(r"\A([0-9a-f]{32})(?:-([0-9]+))?\Z")


class FetchError(Exception):
    """A model that cannot be fetched as it is: the message names the object."""


@dataclass(frozen=True)
class Remote:
    key: str  # the object's key in its bucket
    path: str  # its path in the model's folder: the key less the prefix
    size: int
    etag: str


@dataclass(frozen=True)
class Fetched:
    folder: Path
    files: int
    bytes_fetched: int  # over the network this time: 0 when the folder was complete
    resumed_bytes: int  # bytes a killed fetch had left, kept rather than fetched again


def split(uri: str) -> tuple[str, str]:
    """The bucket and the prefix (empty, or ending in `/`) of an s3:// URI."""
    bucket, _, prefix = uri.removeprefix(S3_SCHEME).partition("/")
    return bucket, (prefix.rstrip("/") + "/") if prefix.strip("/") else ""


def cache_folder(root: Path, uri: str, endpoint: str | None) -> Path:
    """Where under a cache `root` the model at `uri` of a store goes: the same folder for
    every pod and run that names the same model, another for another store."""
    bucket, prefix = split(uri)
    named = f"{endpoint or DEFAULT_ENDPOINT}\n{bucket}/{prefix}"
    digest = hashlib.sha256(named.encode()).hexdigest()
    return root / digest[:24]


def relative_path(key: str, prefix: str) -> str:
    """An object's path inside the model's folder, refused if it could land outside it."""
    path = key.removeprefix(prefix)
    unsafe = any(part in ("", ".", "..") for part in path.split("/"))
    if unsafe or any(ord(c) < 0x20 for c in path) or path.endswith(".part") or path == MANIFEST:
        raise FetchError(f"object {key!r}: not a path inside the model's folder")
    return path


def expected_md5(remote: Remote) -> tuple[str, int]:
    """The MD5 (hex) the store's ETag says, and the number of parts it was taken over (0:
    the whole object's)."""
    found = _ETAG.match(remote.etag.strip('"').lower())
    if found is None:
        raise FetchError(
            f"object {remote.key!r}: ETag {remote.etag!r} is not an MD5, so the file "
            "cannot be checked (objects encrypted with a KMS key have such ETags)"
        )
    return found[1], int(found[2] or 0)


def file_md5(path: Path, parts: int, part_size: int) -> str:
    """The file's MD5 as the store reckons its ETag: over the whole, or over `parts` parts
    of `part_size` bytes (the last shorter) as the MD5 of their MD5s."""
    with path.open("rb") as f:
        if parts == 0:
            return hashlib.file_digest(f, "md5").hexdigest()
        digests = b""
        for _ in range(parts):
            part = hashlib.md5()
            left = part_size
            while left and (chunk := f.read(min(CHUNK, left))):
                part.update(chunk)
                left -= len(chunk)
            digests += part.digest()
        return hashlib.md5(digests).hexdigest()


def client(endpoint: str | None) -> Minio:
    """A client of the store, credentials from the environment as AWS's tools read them
    (in a pod: the init container's, from the Secret `spec.model.credentialsSecret`)."""
    from minio import Minio

    url = urlsplit(endpoint or DEFAULT_ENDPOINT)
    return Minio(
        url.netloc,
        access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
        secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        session_token=os.environ.get("AWS_SESSION_TOKEN"),
        region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
        secure=url.scheme == "https",
    )


def listing(store: Minio, uri: str) -> list[Remote]:
    bucket, prefix = split(uri)
    found = [
        Remote(o.object_name, relative_path(o.object_name, prefix), o.size or 0, o.etag or "")
        for o in store.list_objects(bucket, prefix=prefix, recursive=True)
        if o.object_name and not o.object_name.endswith("/")
    ]
    if not found:
        raise FetchError(f"{uri}: no object under this prefix")
    return found


def _part_size(store: Minio, bucket: str, remote: Remote) -> int:
    first = store.stat_object(bucket, remote.key, extra_query_params={"partNumber": "1"})
    return first.size or 0


def _fetch_one(store: Minio, bucket: str, remote: Remote, folder: Path) -> tuple[int, int]:
    """Fetches one object into its place (resuming its part file); (fetched, kept) bytes."""
    final = folder / remote.path
    final.parent.mkdir(parents=True, exist_ok=True)
    md5, parts = expected_md5(remote)
    part = final.with_name(f"{final.name}.{md5}.part")
    for stale in final.parent.glob(f"{final.name}.*.part"):
        if stale != part:
            stale.unlink()
    kept = part.stat().st_size if part.exists() else 0
    if kept > remote.size:
        part.unlink()
        kept = 0
    fetched = 0
    if kept < remote.size:
        response = store.get_object(bucket, remote.key, offset=kept)
        try:
            with part.open("ab") as out:
                for chunk in response.stream(CHUNK):
                    out.write(chunk)
                    fetched += len(chunk)
                out.flush()
                os.fsync(out.fileno())
        finally:
            response.close()
            response.release_conn()
    part.touch()  # an empty object has no bytes to fetch, and a part all the same
    part_size = _part_size(store, bucket, remote) if parts else 0
    if file_md5(part, parts, part_size) != md5:
        part.unlink()  # a retry fetches it whole
        raise FetchError(
            f"object {remote.key!r} ({remote.path}): the fetched bytes do not match the "
            f"store's checksum {remote.etag}; the partial file is removed"
        )
    part.replace(final)
    return fetched, kept


def fetch(uri: str, folder: Path, endpoint: str | None = None) -> Fetched:
    """The model at `uri` in `folder`, complete and verified; fetched only what it lacks."""
    store = client(endpoint)
    bucket, _ = split(uri)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder.parent / f"{folder.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other pods wait, then find it done
        remotes = listing(store, uri)
        want = {r.path: r.etag for r in remotes}
        manifest = folder / MANIFEST
        have = json.loads(manifest.read_text()) if manifest.exists() else {}
        fetched = kept = 0
        for remote in remotes:
            if have.get(remote.path) == remote.etag and (folder / remote.path).exists():
                continue
            more, left = _fetch_one(store, bucket, remote, folder)
            fetched, kept = fetched + more, kept + left
            # Each file as it is done: a fetch killed later does not fetch it again.
            have[remote.path] = remote.etag
            manifest.write_text(json.dumps(have, sort_keys=True))
        for gone in set(have) - set(want):  # the store's model no longer has them
            (folder / gone).unlink(missing_ok=True)
        manifest.write_text(json.dumps(want, sort_keys=True))
    return Fetched(folder, len(remotes), fetched, kept)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet.launch.objectstore",
        description="Fetch a model from an S3-compatible store into a cache folder.",
    )
    parser.add_argument("uri", help="s3://BUCKET/PREFIX")
    parser.add_argument("--cache", type=Path, required=True, help="the cache volume's root")
    parser.add_argument("--endpoint", help=f"the store's URL (default {DEFAULT_ENDPOINT})")
    args = parser.parse_args(argv)
    from minio.error import S3Error

    folder = cache_folder(args.cache, args.uri, args.endpoint)
    try:
        done = fetch(args.uri, folder, args.endpoint)
    except (FetchError, S3Error) as e:
        print(f"fetching {args.uri}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"folder": str(done.folder), **_counts(done)}))
    return 0


def _counts(done: Fetched) -> dict[str, int]:
    return {"files": done.files, "bytes_fetched": done.bytes_fetched, "resumed": done.resumed_bytes}


if __name__ == "__main__":
    sys.exit(main())
