"""A version's tensors as a Hugging Face checkpoint (`weightsync.write_checkpoint`): the base
model's other files beside them, none of its weights, and large states in shards with the
index loaders read. The export off a run's stream is tested in test_local_run."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlfleet.weightsync import write_checkpoint


def _base(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    save_file({"old": torch.zeros(2)}, folder / "model.safetensors")
    (folder / "model.safetensors.index.json").write_text("{}")
    return folder


def test_a_checkpoint_is_the_base_folder_with_the_versions_weights(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(6, dtype=torch.bfloat16).view(2, 3), "b": torch.ones(4)}
    files = write_checkpoint(tensors, _base(tmp_path / "base"), tmp_path / "out")
    assert [p.name for p in files] == ["model.safetensors"]
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert names == {"config.json", "tokenizer.json", "model.safetensors"}
    loaded = load_file(files[0])
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():  # bit for bit, in the dtype it was served in
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)


def test_a_large_state_is_written_in_shards_with_their_index(tmp_path: Path) -> None:
    tensors = {f"layer.{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    out = tmp_path / "out"
    files = write_checkpoint(tensors, _base(tmp_path / "base"), out, max_shard_bytes=2048)
    assert [p.name for p in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 1024
    assert set(index["weight_map"]) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(load_file(out / index["weight_map"][name])[name], tensor)
