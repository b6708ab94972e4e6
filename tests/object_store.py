"""A real S3 server for the tests: versitygw (built with the bed's binaries) over a folder,
with one user, its keys given to the fetch as AWS's tools read them."""

from __future__ import annotations

import socket
from pathlib import Path

from minio import Minio

from rlfleet.local.binaries import binary
from rlfleet.local.processes import Supervisor, free_port

ACCESS_KEY, SECRET_KEY = "rlfleet-tests", "a-secret-of-the-tests-only"


class ObjectStore:
    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        (root / "data").mkdir(parents=True)
        (root / "meta").mkdir()
        self.supervisor = Supervisor(root, attached=True)
        self.process = self.supervisor.start(
            "versitygw",
            [
                *(binary("versitygw"), "--port", f"127.0.0.1:{self.port}"),
                *("--access", ACCESS_KEY, "--secret", SECRET_KEY),
                *("posix", "--sidecar", str(root / "meta"), str(root / "data")),
            ],
        ).process
        self.client = Minio(
            f"127.0.0.1:{self.port}", access_key=ACCESS_KEY, secret_key=SECRET_KEY, secure=False
        )
        # Listening first: the client's own retries would back off for seconds.
        self.supervisor.wait_until("versitygw listening", self._listening, 30, interval=0.05)
        self.client.list_buckets()

    def _listening(self) -> bool:
        socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        return True

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
        self.supervisor.stop_all()
