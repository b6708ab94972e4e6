"""A user's data as tasks: JSON Lines, Parquet and `datasets` folders written by the real
libraries, read back through the column mapping, bad rows named, streamed."""

from __future__ import annotations

import itertools
import json
import logging
import random
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet
import pytest
from pydantic import ValidationError

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.taskdata import MOUNT_DIR, TaskSource
from rlfleet.api.wire import Task, TaskMessage, decode_task_message, encode
from rlfleet.launch import from_spec, pods
from rlfleet.launch.settings import FeedConfig
from rlfleet.operator.config import Images, NatsAccess, Workloads
from rlfleet.operator.workloads.hub import hub_objects
from rlfleet.rollout.environment import taskdata
from rlfleet.rollout.taskfeed.feed import task_source


def source(path: str, **columns: object) -> TaskSource:
    return TaskSource.model_validate({"path": path, "columns": columns or {"prompt": "question"}})


def first_pass(spec: TaskSource, base: Path) -> list[Task]:
    return list(taskdata.read_pass(spec, taskdata.source_root(spec, base)))


def test_json_lines_map_the_users_columns_and_name_each_bad_row(tmp_path: Path, caplog) -> None:
    lines = [
        {"q": "What is 6*7?", "a": 42, "level": "easy", "uid": "t1"},
        {"q": "Say\u2028hi", "a": "hi", "level": "hard", "uid": "t2"},  # a separator inside
        {"a": "no question", "level": "easy", "uid": "t3"},
        {"q": ["not", "text"], "a": "x", "level": "easy", "uid": "t4"},
    ]
    text = "\n".join(json.dumps(line) for line in lines[:2]) + "\n\n{not json\n"
    text += "\n".join(json.dumps(line) for line in lines[2:]) + "\n"
    (tmp_path / "train.jsonl").write_text(text, encoding="utf-8")
    spec = source("train.jsonl", prompt="q", answer="a", id="uid", metadata=["level"])
    before = taskdata.BAD_ROWS._value.get()
    with caplog.at_level(logging.WARNING):
        tasks = first_pass(spec, tmp_path)
    assert [(t.id, t.prompt, t.answer, t.metadata) for t in tasks] == [
        ("t1", "What is 6*7?", "42", {"level": "easy"}),
        ("t2", "Say\u2028hi", "hi", {"level": "hard"}),
    ]
    assert all(t.suite == "train" and not t.tools for t in tasks)
    assert taskdata.BAD_ROWS._value.get() - before == 3
    logged = caplog.text
    assert "train.jsonl:4: skipped: not JSON" in logged
    assert "train.jsonl:5: skipped: no column 'q'" in logged
    assert "train.jsonl:6: skipped: column 'q' is not text" in logged


def test_a_parquet_folder_is_read_file_by_file_in_batches_its_rows_counted_across_them(
    tmp_path: Path, caplog
) -> None:
    count = taskdata.BATCH_ROWS * 2 + 10
    prompts = [f"question {i}" for i in range(count)]
    prompts[300] = None  # row 301: a null prompt
    table = pyarrow.table(
        {"prompt": prompts, "answer": [str(i) for i in range(count)], "blob": [b"x"] * count}
    )
    pyarrow.parquet.write_table(table, tmp_path / "part-0.parquet", row_group_size=100)
    pyarrow.parquet.write_table(table.slice(0, 5), tmp_path / "part-1.parquet")
    spec = source(".", prompt="prompt", answer="answer")
    with caplog.at_level(logging.WARNING):
        tasks = first_pass(spec.model_copy(update={"format": "parquet"}), tmp_path)
    assert len(tasks) == count - 1 + 5  # a folder is its files in name order
    assert tasks[0].id == "part-0-1" and tasks[-1].id == "part-1-5"
    assert "part-0.parquet:301: skipped: column 'prompt' is not text" in caplog.text


def test_a_datasets_folder_with_chat_messages_reads_through_its_arrow_files(tmp_path: Path) -> None:
    rows = {
        "messages": [
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
            [{"role": "user", "content": "Capital of France?"}],
        ],
        "solution": ["4", "Paris"],
        "info": [{"source": "math"}, {"source": "geo"}],
    }
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)})
    splits.save_to_disk(str(tmp_path / "qa"))
    spec = source("qa/train", messages="messages", answer="solution", metadata=["info"])
    tasks = first_pass(spec, tmp_path)
    assert [t.prompt for t in tasks] == ["2+2?", "Capital of France?"]
    assert tasks[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert tasks[1].metadata == {"info": {"source": "geo"}} and tasks[1].suite == "train"
    # The task travels to the workers with its conversation and metadata.
    message = decode_task_message(encode(TaskMessage(run="r", task=tasks[0])))
    assert message.task == tasks[0]
    with pytest.raises(taskdata.SourceError, match=r"tasks\.path: .*name one of \['train'\]"):
        taskdata.check(source("qa"), tmp_path / "qa")


def test_a_source_that_cannot_be_read_names_the_field_before_any_task(tmp_path: Path) -> None:
    with pytest.raises(taskdata.SourceError, match=r"^spec\.rollout\.tasks\.path: .* not exist"):
        taskdata.check(source("absent.jsonl"), tmp_path / "absent.jsonl")
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(taskdata.SourceError, match=r"tasks\.path: .*cannot be read as parquet"):
        taskdata.check(source("fake.parquet"), tmp_path / "fake.parquet")
    (tmp_path / "wrong.jsonl").write_text('{"text": "a column the mapping does not name"}\n')
    passes = taskdata.data_passes(source("wrong.jsonl"), tmp_path / "wrong.jsonl", 0)
    with pytest.raises(taskdata.SourceError, match=r"tasks\.columns: no row .* makes a task"):
        next(passes)


def test_a_shuffled_pass_holds_at_most_its_window_and_keeps_every_task() -> None:
    pulled = 0

    def counted(n: int):
        nonlocal pulled
        for i in range(n):
            pulled += 1
            yield i

    seen = []
    for item in taskdata.shuffled(counted(5000), random.Random(1), window=64):
        assert pulled - len(seen) <= 64  # no more than the window read ahead
        seen.append(item)
    assert sorted(seen) == list(range(5000)) and seen != sorted(seen)


def test_the_feed_streams_the_runs_data_endlessly_in_a_new_order_each_pass(tmp_path: Path) -> None:
    lines = "".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(5))
    (tmp_path / "t.jsonl").write_text(lines)
    config = FeedConfig(
        run="r",
        nats_url="nats://x",
        suite="toy",
        tasks=source("t.jsonl").model_dump(mode="json"),
        tasks_dir=str(tmp_path),
    )
    tasks = task_source(config)
    passes = [[t.prompt for t in itertools.islice(tasks, 5)] for _ in range(3)]
    assert all(sorted(p) == [f"q{i}" for i in range(5)] for p in passes)
    assert len({tuple(p) for p in passes}) > 1


def test_a_runs_task_volume_is_mounted_read_only_in_its_feed_alone() -> None:
    import yaml
    from conftest import ROOT

    run = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    run["metadata"] |= {"namespace": "team-a", "uid": "uid"}
    run["spec"]["rollout"]["tasks"] = {
        "path": "gsm/train",
        "volume": {"persistentVolumeClaim": "team-data"},
        "columns": {"prompt": "question", "answer": "answer"},
    }
    made = hub_objects(run, Images(), Workloads(), NatsAccess(url="nats://n:4222"))
    mounted = {}
    for workload in (o for o in made if o["kind"] in ("Deployment", "StatefulSet")):
        pod = workload["spec"]["template"]["spec"]
        claims = [v for v in pod.get("volumes", []) if v.get("name") == "tasks"]
        mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tasks"]
        mounted[workload["metadata"]["name"]] = (claims, mounts)
    feed = mounted.pop(f"{run['metadata']['name']}-feed")
    assert feed == (
        [{"name": "tasks", "persistentVolumeClaim": {"claimName": "team-data"}}],
        [{"name": "tasks", "mountPath": MOUNT_DIR, "readOnly": True}],
    )
    assert all(found == ([], []) for found in mounted.values())
    spec = RLRunSpec.model_validate(run["spec"])
    settings = from_spec.feed_settings("r", spec, pods.Placement("nats://n:4222"))
    assert settings.tasks_dir == MOUNT_DIR and settings.tasks["path"] == "gsm/train"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"path": "../etc/passwd"}, "no .. part"),
        ({"columns": {"prompt": "q", "messages": "m"}}, "one of prompt or messages"),
        ({"columns": {"answer": "a"}}, "one of prompt or messages"),
        ({"volume": {}}, "one of persistentVolumeClaim or configMap"),
        ({"path": "/abs/train.jsonl"}, "path"),
    ],
)
def test_a_task_source_a_server_would_refuse_is_refused_by_rlfleet_run_too(
    change: dict, message: str
) -> None:
    document = {"path": "train.jsonl", "columns": {"prompt": "q"}} | change
    with pytest.raises(ValidationError, match=message):
        TaskSource.model_validate(document)
