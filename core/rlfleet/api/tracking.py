"""Where a run's numbers go besides Prometheus and its step log: an experiment tracker the
ML engineers compare runs in. The trainer logs to it (`rlfleet.trainer.tracking`), never
waiting on it: a tracker that is down or slow costs dropped entries, counted, not steps."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from rlfleet.api.meta import DNS_LABEL, ApiModel

Name = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)]


class MlflowTracking(ApiModel):
    """An MLflow tracking server: one MLflow run per RLRun, found again after a restart."""

    tracking_uri: Annotated[
        str,
        Field(
            max_length=2048,
            pattern=r"^https?://[^\s]+$",
            description="The tracking server's URL, as MLFLOW_TRACKING_URI names it.",
        ),
    ]
    experiment: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=256,
            description="The experiment the run is logged under; none: the RLRun's namespace.",
        ),
    ] = None
    credentials_secret: Annotated[
        Name | None,
        Field(
            description=(
                "A Secret in the hub's run namespace with MLFLOW_TRACKING_TOKEN, or "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, which the trainer "
                "alone reads; none: no authentication."
            )
        ),
    ] = None


class TrackingSpec(ApiModel):
    """The experiment trackers a run logs to: every step report's numbers (reward, loss,
    staleness, KL, tokens per second, delta bytes, learning rate) at its step, and the
    spec as the tracker's parameters."""

    mlflow: MlflowTracking
