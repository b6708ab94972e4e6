"""Tasks from a user's own data: JSON Lines, Parquet or a Hugging Face `datasets` folder,
read by the run's task feed from a volume it mounts (`rlfleet.rollout.environment.taskdata`).

Rows become `Task`s through a mapping from the data's columns, so a dataset is used as it
was written: no export to rlfleet's own schema.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from rlfleet.api.meta import DNS_LABEL, ApiModel, cel

# Where the feed's pod mounts the source's volume, read-only.
MOUNT_DIR = "/var/run/rlfleet/tasks"
Format = Literal["jsonl", "parquet", "datasets"]

Name = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL)]
Column = Annotated[str, Field(min_length=1, max_length=253)]
# Relative and printable; `..` is refused by a rule (the API server's patterns are RE2).
RELATIVE_PATH = r"^[^/\x00-\x1f][^\x00-\x1f]*$"
PATH_MAX = 1024


VOLUME_RULE = cel(
    "has(self.persistentVolumeClaim) != has(self.configMap)",
    "name one of persistentVolumeClaim or configMap",
)
QUESTION_RULE = cel(
    "has(self.prompt) != has(self.messages)",
    "name one of prompt or messages: the column the model is asked",
)
INSIDE_RULE = cel(
    "!(self.path == '..' || self.path.startsWith('../') ||"
    " self.path.endsWith('/..') || self.path.contains('/../'))",
    "path must stay inside the volume: no .. part",
    ".path",
)


class TaskVolume(ApiModel):
    """The volume holding the data, in the hub's cluster and the run's namespace."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [VOLUME_RULE]})

    persistent_volume_claim: Annotated[
        Name | None, Field(description="A PersistentVolumeClaim, mounted read-only.")
    ] = None
    config_map: Annotated[
        Name | None,
        Field(description="A ConfigMap (up to 1 MiB), its keys the files of the folder."),
    ] = None

    @model_validator(mode="after")
    def _one_volume(self) -> TaskVolume:
        """The CEL rule, for a spec no API server checks (`rlfleet run`)."""
        if (self.persistent_volume_claim is None) == (self.config_map is None):
            raise ValueError(VOLUME_RULE["message"])
        return self


class TaskColumns(ApiModel):
    """Which of the data's columns make a task."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [QUESTION_RULE]})

    prompt: Annotated[
        Column | None, Field(description="A text column: the question the model is asked.")
    ] = None
    messages: Annotated[
        Column | None,
        Field(
            description=(
                "Or a column of chat messages ({role, content} each): the conversation the"
                " model continues; its last user message is the task's prompt."
            )
        ),
    ] = None
    answer: Annotated[
        Column | None,
        Field(description="The reference answer (exactAnswer rewards, harnesses' scorers)."),
    ] = None
    id: Annotated[
        Column | None,
        Field(description="A column of unique task ids; unset: the file's name and row number."),
    ] = None
    metadata: Annotated[
        list[Column],
        Field(
            max_length=64,
            description="Columns handed to the environment as the task's metadata, as they are.",
            default_factory=list,
        ),
    ]

    @model_validator(mode="after")
    def _one_question(self) -> TaskColumns:
        """The CEL rule, for a spec no API server checks (`rlfleet run`)."""
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(QUESTION_RULE["message"])
        return self


class TaskSource(ApiModel):
    """The run's own tasks: rows of a file or folder, streamed by the task feed."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [INSIDE_RULE]})

    path: Annotated[
        str,
        Field(
            pattern=RELATIVE_PATH,
            max_length=PATH_MAX,
            description=(
                "The file or folder, relative to the volume's root; without a volume, to the"
                " feed's working folder (a file in its image, or rlfleet run's spec folder)."
            ),
        ),
    ]
    volume: Annotated[
        TaskVolume | None,
        Field(description=f"The volume the feed mounts read-only at {MOUNT_DIR}."),
    ] = None
    format: Annotated[
        Format | None,
        Field(
            description=(
                "jsonl, parquet, or datasets (a folder written by Dataset.save_to_disk);"
                " unset: from the path (.jsonl, .parquet, else a datasets folder)."
            )
        ),
    ] = None
    columns: Annotated[TaskColumns, Field(description="Which columns make a task.")]

    @model_validator(mode="after")
    def _inside(self) -> TaskSource:
        """The CEL rule, for a spec no API server checks (`rlfleet run`)."""
        if ".." in self.path.split("/"):
            raise ValueError(INSIDE_RULE["message"])
        return self
