"""A real MLflow tracking server for the tests, in a virtualenv of its own under the
user's cache (its dependencies would not lock beside the project's), made once per version
with the uv `make setup` installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

from images import ROOT, uv
from rlfleet.local.processes import Supervisor, free_port


def _version() -> str:
    found = re.search(r"^MLFLOW_VERSION=(\S+)", (ROOT / "versions.env").read_text(), re.M)
    assert found, "versions.env names no MLFLOW_VERSION"
    return found[1]


def environment() -> Path:
    """The `mlflow` command of the server's virtualenv, made if missing: in a folder of its
    own first, renamed into place once whole, so a killed install is not taken for one."""
    version = _version()
    venv = Path(uv()).parent.parent.parent / f"mlflow-{version}"
    if not (venv / "bin" / "mlflow").exists():
        staging = venv.with_name(f"{venv.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        python = staging / "bin" / "python"
        for args in (
            ["venv", "--quiet", "--relocatable", "--python", "3.11", staging],
            ["pip", "install", "--quiet", "--python", python, f"mlflow=={version}"],
        ):
            done = subprocess.run([uv(), *map(str, args)], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
        staging.rename(venv)
    return venv / "bin" / "mlflow"


class MlflowServer:
    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.supervisor = Supervisor(root, attached=True)
        self.supervisor.start(
            "mlflow",
            [
                *(str(environment()), "server", "--host", "127.0.0.1", "--port", str(self.port)),
                *("--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"),
                *("--artifacts-destination", str(root / "artifacts"), "--workers", "1"),
            ],
        )
        self.supervisor.wait_until("the MLflow server's health", self._healthy, 120, 0.2)

    def _healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
            return response.status == 200

    def call(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"{self.uri}/api/2.0/mlflow/{path}",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def get(self, path: str, **query: str) -> dict:
        encoded = urllib.parse.urlencode(query)
        with urllib.request.urlopen(f"{self.uri}/api/2.0/mlflow/{path}?{encoded}") as response:
            return json.loads(response.read())

    def run_of(self, experiment: str, run_name: str) -> dict:
        """The MLflow run the trainer logged the RLRun `run_name` to."""
        found = self.get("experiments/get-by-name", experiment_name=experiment)
        search = {
            "experiment_ids": [found["experiment"]["experiment_id"]],
            "filter": f"tags.`rlfleet.run` = '{run_name}'",
        }
        (run,) = self.call("runs/search", search)["runs"]
        return run

    def history(self, run_id: str, key: str) -> list[dict]:
        return self.get("metrics/get-history", run_id=run_id, metric_key=key)["metrics"]

    def stop(self) -> None:
        self.supervisor.stop_all()
