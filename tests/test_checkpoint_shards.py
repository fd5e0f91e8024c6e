"""A sharded checkpoint's index may only name shards inside the checkpoint directory (issue 37, finding 4).

A real tiny Qwen2.5-Omni checkpoint (`omni-mesh models tiny`) is split into two real safetensors shards
with a `model.safetensors.index.json`, as `save_pretrained` writes large models. The split loads exactly
as the single file does; an index naming a shard outside the directory (`../`, an absolute path, a
symlink leading out) is refused with an error naming the index and the shard, before anything is read;
a Hugging Face cache snapshot, whose files are all symlinks into the repository's blobs/, still loads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from omni_mesh.engines.checkpoint import CheckpointError, read_part  # noqa: E402
from omni_mesh.engines.qwen2_5_omni import Thinker  # noqa: E402
from omni_mesh.engines.tiny import build_tiny  # noqa: E402

INDEX = "model.safetensors.index.json"
THINKER_SHARD = "model-00001-of-00002.safetensors"
OTHER_SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("qwen2_5_omni", tmp_path_factory.mktemp("single") / "model")


def shard(single: Path, directory: Path, thinker_shard: str = THINKER_SHARD) -> Path:
    """`single` as a two-shard checkpoint in `directory`: the thinker's tensors in one shard, the rest
    in the other; the index names the thinker's shard `thinker_shard` (written where it says only
    when that is inside `directory`)."""
    shutil.copytree(single, directory, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(str(single / "model.safetensors"))
    thinker = {k: v for k, v in tensors.items() if k.startswith("thinker.")}
    other = {k: v for k, v in tensors.items() if not k.startswith("thinker.")}
    save_file(thinker, str(directory / THINKER_SHARD), metadata={"format": "pt"})
    save_file(other, str(directory / OTHER_SHARD), metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(thinker, thinker_shard), **dict.fromkeys(other, OTHER_SHARD)}
    (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def assert_refused(checkpoint: Path, name: str, *more: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        read_part(checkpoint, "thinker.")
    message = str(caught.value)
    assert str(checkpoint / INDEX) in message and repr(name) in message, message
    assert "outside the checkpoint directory" in message and all(m in message for m in more), message
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):  # the engine refuses too
        Thinker.load(checkpoint, torch.float32, "cpu")


def test_a_sharded_checkpoint_loads_like_the_single_file(single: Path, tmp_path: Path) -> None:
    sharded = shard(single, tmp_path / "sharded")
    expected, got = read_part(single, "thinker."), read_part(sharded, "thinker.")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    Thinker.load(sharded, torch.float32, "cpu")


def test_a_shard_named_with_dot_dot_is_refused(single: Path, tmp_path: Path) -> None:
    checkpoint = shard(single, tmp_path / "model", "../outside.safetensors")
    (tmp_path / "model" / THINKER_SHARD).rename(tmp_path / "outside.safetensors")  # a real shard is there
    assert_refused(checkpoint, "../outside.safetensors")


def test_a_shard_named_by_an_absolute_path_is_refused(single: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "outside.safetensors"
    checkpoint = shard(single, tmp_path / "model", str(outside))
    outside.parent.mkdir()
    (checkpoint / THINKER_SHARD).rename(outside)
    assert_refused(checkpoint, str(outside))


def test_a_shard_that_is_a_symlink_out_of_the_directory_is_refused(single: Path, tmp_path: Path) -> None:
    checkpoint = shard(single, tmp_path / "model")
    outside = tmp_path / "outside.safetensors"
    (checkpoint / THINKER_SHARD).rename(outside)
    (checkpoint / THINKER_SHARD).symlink_to(outside)
    assert_refused(checkpoint, THINKER_SHARD, str(outside))


def test_the_single_file_as_a_symlink_out_of_the_directory_is_refused(single: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "model"
    shutil.copytree(single, checkpoint, ignore=shutil.ignore_patterns("model.safetensors"))
    (checkpoint / "model.safetensors").symlink_to(single / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"'model\.safetensors' is a symlink to .* outside the checkpoint"
    ):
        read_part(checkpoint, "thinker.")


def test_a_hugging_face_cache_snapshot_loads(single: Path, tmp_path: Path) -> None:
    """The hub's cache keeps each file once in blobs/ and links it from snapshots/REV/: those
    symlinks lead out of the snapshot directory, into its own repository's blobs/."""
    sharded = shard(single, tmp_path / "sharded")
    repo = tmp_path / "hub" / "models--tiny--qwen2_5_omni"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, path in enumerate(sorted(p for p in sharded.rglob("*") if p.is_file())):
        relative = path.relative_to(sharded)
        shutil.copyfile(path, repo / "blobs" / f"blob{number}")
        (snapshot / relative).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / relative).symlink_to(
            os.path.relpath(repo / "blobs" / f"blob{number}", (snapshot / relative).parent)
        )
    expected, got = read_part(single, "thinker."), read_part(snapshot, "thinker.")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
