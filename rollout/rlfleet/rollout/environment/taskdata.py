"""A user's data as tasks: rows of JSON Lines, Parquet or a `datasets` folder, streamed.

The run names a file or folder and which columns make a task (`rlfleet.api.taskdata`).
Rows are read a batch at a time, so a million-row dataset never sits in memory: JSON Lines
line by line, Parquet by row batch (only the mapped columns), and a folder written by
`datasets.Dataset.save_to_disk` through its Arrow stream files, read by pyarrow directly
(the feed needs no `datasets` library). A folder of `.jsonl` or `.parquet` files is read
file by file in name order, as sharded datasets are written.

A row that cannot be a task (a missing column, a prompt that is not text) is skipped and
reported with its file and row number, counted in `rlfleet_taskfeed_bad_rows_total`: one
bad row of a million should not stop a run, and the on-call sees which it was. A source
that cannot be opened, or a pass with no good row, is an error naming
`spec.rollout.tasks`.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import prometheus_client

from rlfleet.api.taskdata import Format, TaskSource
from rlfleet.api.wire import Task

log = logging.getLogger(__name__)

BATCH_ROWS = 256  # rows decoded at a time from Parquet and Arrow
SHUFFLE_ROWS = 1024  # a pass is shuffled within a window of this many tasks
LOGGED_BAD_ROWS = 20  # bad rows logged one by one; the rest only counted
FIELD = "spec.rollout.tasks"

BAD_ROWS = prometheus_client.Counter(
    "rlfleet_taskfeed_bad_rows", "Rows of the run's task data that could not be a task."
)

Row = dict[str, Any]


class SourceError(ValueError):
    """The run's task data cannot be read; says which field to look at."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{FIELD}.{field}: {message}")


class BadRow(ValueError):
    """One row that cannot be a task."""


def source_format(source: TaskSource) -> Format:
    """The source's format: as given, else read off the path's suffix."""
    if source.format is not None:
        return source.format
    for suffix in ("jsonl", "parquet"):
        if source.path.endswith(f".{suffix}"):
            return suffix
    return "datasets"


def data_files(root: Path, fmt: str) -> list[Path]:
    """The files a source's path names, in the order they are read."""
    if not root.exists():
        raise SourceError("path", f"{root} does not exist")
    if fmt == "datasets":
        return _arrow_files(root)
    if root.is_file():
        return [root]
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix == f".{fmt}")
    if not files:
        raise SourceError("path", f"{root} holds no .{fmt} file")
    return files


def _arrow_files(root: Path) -> list[Path]:
    """A `save_to_disk` folder's Arrow files, as its state.json lists them."""
    if (root / "dataset_dict.json").exists():
        splits = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise SourceError("path", f"{root} holds several splits: name one of {splits}")
    try:
        state = json.loads((root / "state.json").read_text(encoding="utf-8"))
        return [root / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SourceError(
            "path", f"{root} is not a folder written by Dataset.save_to_disk: {error!r}"
        ) from error


def rows(path: Path, fmt: str, columns: list[str]) -> Iterator[Row]:
    """One file's rows in order, as mappings of the given columns (all, for JSON Lines)."""
    if fmt == "jsonl":
        yield from _json_lines(path)
        return
    import pyarrow.parquet

    if fmt == "parquet":
        batches = pyarrow.parquet.ParquetFile(path).iter_batches(
            batch_size=BATCH_ROWS, columns=_present(path, columns)
        )
    else:
        batches = _arrow_batches(path, columns)
    for batch in batches:
        yield from batch.to_pylist()


def _present(path: Path, columns: list[str]) -> list[str]:
    import pyarrow.parquet

    names = set(pyarrow.parquet.read_schema(path).names)
    return [column for column in columns if column in names]  # absent: each row says so


def _arrow_batches(path: Path, columns: list[str]) -> Iterable[Any]:
    import pyarrow

    with pyarrow.memory_map(str(path)) as source:
        for batch in pyarrow.ipc.open_stream(source):
            present = [column for column in columns if column in batch.schema.names]
            yield batch.select(present)


def _json_lines(path: Path) -> Iterator[Row]:
    # Binary lines split on b"\n" only: JSON strings may hold other separators (U+2028).
    with path.open("rb") as lines:
        for line in lines:
            if not line.strip():
                yield {}  # keeps row numbers those of the file's lines; skipped as empty
                continue
            try:
                row = msgspec.json.decode(line)
            except msgspec.DecodeError as error:
                yield {"\0error": f"not JSON: {error}"}
                continue
            yield row if isinstance(row, dict) else {"\0error": "not a JSON object"}


def task(source: TaskSource, row: Row, file: Path, number: int) -> Task:
    """The task a row makes under the source's column mapping, or `BadRow`."""
    if "\0error" in row:
        raise BadRow(row["\0error"])
    columns = source.columns
    prompt, messages = "", []
    if columns.messages is not None:
        messages = _messages(_column(row, columns.messages))
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        if not prompt:
            raise BadRow(f"column {columns.messages!r} has no user message")
    else:
        prompt = _column(row, columns.prompt or "")
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadRow(f"column {columns.prompt!r} is not text")
    answer = None if columns.answer is None else _column(row, columns.answer)
    ident = f"{file.stem}-{number}" if columns.id is None else _column(row, columns.id)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)  # numeric answers, as GSM8K-like data holds them
    if answer is not None and not isinstance(answer, str):
        raise BadRow(f"column {columns.answer!r} is not text or a number")
    return Task(
        id=str(ident),
        suite=file.parent.name if source_format(source) == "datasets" else file.stem,
        prompt=prompt,
        answer=answer,
        tools=False,  # a question as the data asks it, without rlfleet's tool protocol
        messages=messages,
        metadata={name: _column(row, name) for name in columns.metadata},
    )


def _column(row: Row, name: str) -> Any:
    if name not in row:
        raise BadRow(f"no column {name!r} (it has {sorted(row)[:16]})")
    return row[name]


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRow("messages is not a list of messages")
    for message in value:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise BadRow("a message is not {role: text, content: text}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def mapped_columns(source: TaskSource) -> list[str]:
    c = source.columns
    named = [c.prompt, c.messages, c.answer, c.id, *c.metadata]
    return [name for name in named if name is not None]


def read_pass(source: TaskSource, root: Path) -> Iterator[Task]:
    """Every good row of the source once, in order; bad rows logged and counted."""
    fmt, columns, bad = source_format(source), mapped_columns(source), 0
    for file in data_files(root, fmt):
        for number, row in enumerate(rows(file, fmt, columns), start=1):
            if not row:
                continue
            try:
                yield task(source, row, file, number)
            except (BadRow, msgspec.ValidationError, ValueError) as error:
                bad += 1
                BAD_ROWS.inc()
                if bad <= LOGGED_BAD_ROWS:
                    log.warning("%s:%d: skipped: %s", file, number, error)


def shuffled(
    tasks: Iterable[Task], rng: random.Random, window: int = SHUFFLE_ROWS
) -> Iterator[Task]:
    """`tasks` in a random order within a bounded window: memory stays `window` tasks."""
    held: list[Task] = []
    for item in tasks:
        held.append(item)
        if len(held) >= window:
            yield held.pop(rng.randrange(len(held)))
    rng.shuffle(held)
    yield from held


def data_passes(source: TaskSource, root: Path, seed: int) -> Iterator[Task]:
    """The source over and over, each pass in a new order, streamed."""
    rng = random.Random(seed)
    while True:
        empty = True
        for item in shuffled(read_pass(source, root), rng):
            empty = False
            yield item
        if empty:
            raise SourceError("columns", f"no row of {root} makes a task (see the log)")


def source_root(source: TaskSource, base: Path) -> Path:
    """Where the source's path is, as this process sees it."""
    return base / source.path


def check(source: TaskSource, root: Path) -> None:
    """Opens the source now, so a path or format that cannot be read stops the feed at its
    start, naming the field, rather than at its first task."""
    fmt = source_format(source)
    try:
        first = next(iter(rows(data_files(root, fmt)[0], fmt, mapped_columns(source))), None)
    except SourceError:
        raise
    except Exception as error:  # pyarrow's and the file system's own errors
        raise SourceError("path", f"{root} cannot be read as {fmt}: {error}") from error
    if first is None:
        raise SourceError("path", f"{root} holds no row")
