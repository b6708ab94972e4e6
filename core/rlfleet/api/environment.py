"""The environment a run's rollouts act in: rlfleet's own agent, or a user's plug-in.

An environment is the harness that drives the model, the tasks it is asked and the reward
that scores it. Environments are found by name in one registry, the Python entry-point
group `rlfleet.environments` (`rlfleet.rollout.environment.plugins`), so a user's
package installed in the rollout image is a run's environment without rlfleet changing;
`module:attribute` names a factory on the path directly, for code not yet packaged.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from rlfleet.api.meta import ApiModel

ENTRY_POINT_GROUP = "rlfleet.environments"
BUILT_IN = "agent"  # rlfleet's own agent loop, tools and task suites
# An entry point's name, or `module.path:attribute`.
PLUGIN_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]*(:[A-Za-z_][A-Za-z0-9_.]*)?$"


class EnvironmentSpec(ApiModel):
    """Which environment the rollout workers run, and its settings."""

    name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            pattern=PLUGIN_NAME,
            description=(
                f"An environment registered in the entry-point group {ENTRY_POINT_GROUP} of"
                " the rollout image (agent: rlfleet's own agent loop and suites), or"
                " module:factory on its Python path."
            ),
        ),
    ] = BUILT_IN
    settings: Annotated[
        dict[str, Any],
        Field(
            description=(
                "The environment's own settings, which it checks itself as the run's task"
                " feed and rollout workers start: one it refuses stops them before they take"
                " any work, their log naming the setting."
            ),
            default_factory=dict,
            json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
        ),
    ]
    episode_seconds: Annotated[
        float,
        Field(
            gt=0,
            le=86400,
            description=(
                "How long one episode (harness and reward) may take; past it the episode"
                " fails (reason deadline) and its group is tried again."
            ),
        ),
    ] = 600.0
