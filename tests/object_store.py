"""A real S3 server for the tests: versitygw (built with the bed's binaries) over a folder,
with one user, its keys given to the fetch as AWS's tools read them."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from minio import Minio

from rlfleet.local.binaries import binary
from rlfleet.local.processes import free_port

ACCESS_KEY, SECRET_KEY = "rlfleet-tests", "a-secret-of-the-tests-only"


class ObjectStore:
    def __init__(self, root: Path) -> None:
        program = binary("versitygw")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        (root / "data").mkdir(parents=True)
        (root / "meta").mkdir()
        self._log = (root / "versitygw.log").open("w")
        self.process = subprocess.Popen(
            [
                *(program, "--port", f"127.0.0.1:{self.port}"),
                *("--access", ACCESS_KEY, "--secret", SECRET_KEY),
                *("posix", "--sidecar", str(root / "meta"), str(root / "data")),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.client = Minio(
            f"127.0.0.1:{self.port}", access_key=ACCESS_KEY, secret_key=SECRET_KEY, secure=False
        )
        deadline = time.monotonic() + 30
        while True:  # listening: the client's own retries would back off for seconds
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert self.process.poll() is None, (root / "versitygw.log").read_text()
                assert time.monotonic() < deadline, "versitygw did not listen in 30 s"
                time.sleep(0.05)
        self.client.list_buckets()

    @property
    def credentials(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    def upload(self, folder: Path, bucket: str, prefix: str, part_size: int = 5 << 20) -> None:
        """Every file under `folder`, as `aws s3 cp --recursive` would put them: a file
        over one part multipart, so its ETag is the MD5 of its parts' MD5s."""
        if not self.client.bucket_exists(bucket):
            self.client.make_bucket(bucket)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(folder)}"
            self.client.fput_object(bucket, key, str(path), part_size=part_size)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self._log.close()
