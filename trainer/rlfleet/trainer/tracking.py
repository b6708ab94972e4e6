"""The run in an MLflow tracking server: each step report's numbers at its step, and the
spec as the run's parameters (`spec.tracking.mlflow`).

Training never waits on the tracker. Reports go into a bounded queue that one thread
drains over MLflow's REST API; while the server is down or slow the queue fills, and what
does not fit is dropped and counted (`rlfleet_tracking_dropped_total`), with how long the
server has been unreachable (`rlfleet_tracking_unreachable_seconds`). The MLflow run is
found again by its tag after a restart, so a resumed trainer goes on logging into it.
Standard library HTTP only: the trainer's image gains no MLflow client and its
dependencies.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import msgspec
from prometheus_client import Counter, Gauge

from rlfleet.api.wire import StepReport
from rlfleet.launch.settings import TrackingConfig

log = logging.getLogger(__name__)

RUN_TAG = "rlfleet.run"
# MLflow takes at most 100 parameters a batch, each value at most 6,000 characters.
PARAMS_PER_BATCH = 100
PARAM_CHARS = 6000
RETRY_S = 2.0
TIMEOUT_S = 10.0
TRACKING_FLUSH_S = 15.0  # what a stopping trainer gives the tracker to log its last steps

dropped = Counter("rlfleet_tracking_dropped_total", "Step reports the tracker could not keep")
unreachable = Gauge(
    "rlfleet_tracking_unreachable_seconds", "How long the tracking server has failed (0: fine)"
)


def step_metrics(report: StepReport) -> dict[str, float]:
    """What a step report says, as the tracker's metrics."""
    seconds = report.step_seconds or float("nan")
    return {
        "reward": report.reward_mean,
        "loss": report.loss,
        "staleness_mean": report.staleness_mean,
        "staleness_max": float(report.staleness_max),
        "kl": report.mismatch_kl,
        "mismatch_mean_abs": report.mismatch_mean_abs,
        "clipped_fraction": report.clipped_fraction,
        "tokens": float(report.tokens),
        "tokens_per_second": report.tokens / seconds,
        "delta_bytes": float(report.weight_bytes),
        "weight_seconds": report.weight_seconds,
        "wait_seconds": report.wait_seconds,
        "step_seconds": report.step_seconds,
        "learning_rate": report.learning_rate,
        "policy_version": float(report.policy_version),
        "dropped_stale_total": float(report.dropped_stale_total),
    }


class MlflowClient:
    """The few calls of MLflow's REST API (2.0) the tracker makes."""

    def __init__(self, uri: str) -> None:
        self.base = uri.rstrip("/") + "/api/2.0/mlflow/"
        self.headers = {"Content-Type": "application/json"}
        if token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
            self.headers["Authorization"] = f"Bearer {token}"
        elif user := os.environ.get("MLFLOW_TRACKING_USERNAME"):
            pair = f"{user}:{os.environ.get('MLFLOW_TRACKING_PASSWORD', '')}".encode()
            self.headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()

    def call(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode() if method == "POST" else None
        url = self.base + path
        if method == "GET":
            url += "?" + urllib.parse.urlencode(body)
        request = urllib.request.Request(url, data, self.headers, method=method)
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.loads(response.read() or b"{}")

    def experiment_id(self, name: str) -> str:
        try:
            found = self.call("GET", "experiments/get-by-name", {"experiment_name": name})
            return found["experiment"]["experiment_id"]
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise
        return self.call("POST", "experiments/create", {"name": name})["experiment_id"]

    def run_id(self, experiment: str, run_name: str) -> str:
        """The MLflow run tagged as this run's, made the first time."""
        search = {
            "experiment_ids": [experiment],
            "filter": f"tags.`{RUN_TAG}` = '{run_name}'",
            "max_results": 1,
        }
        if runs := self.call("POST", "runs/search", search).get("runs"):
            return runs[0]["info"]["run_id"]
        made = {
            "experiment_id": experiment,
            "run_name": run_name,
            "start_time": int(time.time() * 1000),
            "tags": [{"key": RUN_TAG, "value": run_name}],
        }
        return self.call("POST", "runs/create", made)["run"]["info"]["run_id"]


class Tracker:
    """Logs step reports to the run's MLflow server from a thread of its own."""

    def __init__(self, config: TrackingConfig) -> None:
        self.config = config
        self.client = MlflowClient(config.uri)
        self.reports: queue.Queue[StepReport] = queue.Queue(maxsize=config.queue)
        self.run_id: str | None = None
        self.failing_since: float | None = None
        self.dropped = 0  # this tracker's, beside the process's counter
        self.thread = threading.Thread(target=self._drain, name="tracking", daemon=True)
        self.thread.start()

    def step(self, report: StepReport) -> None:
        """Queued for the tracker, or dropped and counted when the queue is full: never a
        wait."""
        try:
            self.reports.put_nowait(report)
        except queue.Full:
            self._drop()

    def told(self, report: StepReport) -> StepReport:
        """The report, saying how the tracker fares: the hub's status shows it."""
        return msgspec.structs.replace(
            report,
            tracking_unreachable_seconds=round(self.unreachable_s(), 1),
            tracking_dropped_total=self.dropped,
        )

    def unreachable_s(self) -> float:
        since = self.failing_since
        return 0.0 if since is None else time.monotonic() - since

    def _drop(self) -> None:
        self.dropped += 1
        dropped.inc()

    def flush(self, timeout_s: float) -> bool:
        """Waits, at most `timeout_s`, for what is queued to be logged; whether it was."""
        deadline = time.monotonic() + timeout_s
        while self.reports.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.reports.unfinished_tasks

    def _drain(self) -> None:
        while True:
            report = self.reports.get()
            while not self._sent(report):
                time.sleep(RETRY_S)
            self.reports.task_done()

    def _sent(self, report: StepReport) -> bool:
        """Whether the report is done with: logged, or refused for good (counted)."""
        try:
            if self.run_id is None:
                self.run_id = self._open()
            self._log(report)
        except urllib.error.HTTPError as error:
            if not _refused(error):
                return self._failed(error)
            log.warning(
                "tracking server %s refused step %d: %s", self.config.uri, report.step, error
            )
            self._drop()
        except (OSError, ValueError, KeyError) as error:
            return self._failed(error)
        self.failing_since = None
        unreachable.set(0)
        return True

    def _failed(self, error: Exception) -> bool:
        now = time.monotonic()
        self.failing_since = self.failing_since or now
        unreachable.set(now - self.failing_since)
        log.warning("tracking server %s: %s", self.config.uri, error)
        return False

    def _open(self) -> str:
        """The run's MLflow run, with the spec as its parameters (logged again on resume:
        MLflow takes a parameter logged twice with the same value)."""
        run_id = self.client.run_id(
            self.client.experiment_id(self.config.experiment), self.config.run_name
        )
        params = [{"key": k, "value": v[:PARAM_CHARS]} for k, v in self.config.params.items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            batch = {"run_id": run_id, "params": params[i : i + PARAMS_PER_BATCH]}
            try:
                self.client.call("POST", "runs/log-batch", batch)
            except urllib.error.HTTPError as error:
                if not _refused(error):
                    raise
                # A spec changed since the run was opened: MLflow keeps the first values.
                log.warning(
                    "tracking server %s kept earlier parameters: %s", self.config.uri, error
                )
        return run_id

    def _log(self, report: StepReport) -> None:
        at = int(report.finished_at * 1000)
        metrics = [
            {"key": key, "value": value, "timestamp": at, "step": report.step}
            for key, value in step_metrics(report).items()
            if value == value  # MLflow refuses NaN
        ]
        self.client.call("POST", "runs/log-batch", {"run_id": self.run_id, "metrics": metrics})


def _refused(error: urllib.error.HTTPError) -> bool:
    """A request the server will refuse however often it is sent (not 429, not 5xx)."""
    return 400 <= error.code < 500 and error.code != 429
