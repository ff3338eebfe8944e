"""HF model directories: config + safetensors weights (one file, or shards with an index)."""

from __future__ import annotations

import json
import os
import shutil

from ckptbridge.config import read_config_file
from ckptbridge.errors import CorruptFileError, InputNotFoundError, MismatchError, UnsupportedError
from ckptbridge.io import storage
from ckptbridge.io.files import close_on_error, read_json_object
from ckptbridge.io.safetensors import SafetensorsFile, TensorInfo

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
WEIGHT_SUFFIXES = (".safetensors", ".h5", ".msgpack", ".gguf") + PICKLE_SUFFIXES


def safe_member(directory: str, name: object, what: str) -> str:
    """The path of file ``name`` inside ``directory``; refuses names that leave it."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or os.path.isabs(name)
        or "\x00" in name
    ):
        raise CorruptFileError(
            f"{what}: file name {name!r} is not a plain file name inside {directory}; fix the index"
        )
    return check_inside(directory, os.path.join(directory, name))


def check_inside(directory: str, path: str) -> str:
    """``path`` (a file of ``directory``) unless it is a symlink that resolves outside the directory.
    A Hugging Face hub snapshot's links into its own repository's ``blobs/`` are allowed."""
    if not os.path.islink(path):
        return path
    real = os.path.realpath(path)
    allowed = [os.path.realpath(directory)]
    parent = os.path.dirname(os.path.abspath(directory))
    if os.path.basename(parent) == "snapshots":
        allowed.append(os.path.realpath(os.path.join(os.path.dirname(parent), "blobs")))
    if not any(real.startswith(root + os.sep) for root in allowed):
        raise CorruptFileError(f"{path}: a symlink to {real}, outside {directory}; copy the file into the "
                               "directory instead of linking it")
    return path


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")


def read_index(index_path: str, fix: str = "re-download it") -> dict[str, str]:
    """The ``weight_map`` (tensor key -> shard file) of a safetensors index."""
    index = read_json_object(index_path, fix)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptFileError(f"{index_path}: not a valid safetensors index (needs a JSON object with weight_map); "
                               f"{fix}")
    return weight_map


class HFModelDir:
    """A validated HF model directory with lazy access to every tensor."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.exists(path):
            raise InputNotFoundError(f"{path}: no such directory")
        if not os.path.isdir(path):
            raise InputNotFoundError(
                f"{path}: not a directory; give the HF model directory (config.json + *.safetensors)")
        self.config = read_config_file(check_inside(path, os.path.join(path, "config.json")))
        self.files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        with close_on_error(self):
            self._open()

    def _open(self) -> None:
        index_path = os.path.join(self.path, INDEX_NAME)
        single = os.path.join(self.path, SINGLE_NAME)
        if os.path.isfile(index_path):
            check_inside(self.path, index_path)
            weight_map = read_index(index_path, "regenerate it or remove it if the model is a single "
                                                "model.safetensors")
            for key, name in weight_map.items():
                file_path = safe_member(self.path, name, index_path)
                if name not in self.files:
                    if not os.path.isfile(file_path):
                        raise InputNotFoundError(
                            f"{index_path}: names shard {name} for tensor {key!r}, but {file_path} does not "
                            "exist; download the missing shard"
                        )
                    self.files[name] = SafetensorsFile(file_path)
                if key not in self.files[name]:
                    raise MismatchError(
                        f"{index_path}: maps tensor {key!r} to {name}, which has no such tensor; "
                        "the index and the shards disagree"
                    )
                self._where[key] = name
            for name, shard in self.files.items():
                extra = [k for k in shard.keys() if self._where.get(k) != name]
                if extra:
                    raise MismatchError(
                        f"{shard.path}: holds tensor {extra[0]!r} that {INDEX_NAME} does not map to it; "
                        "the index and the shards disagree"
                    )
            return
        if os.path.isfile(single):
            names = [SINGLE_NAME]
        else:
            names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not names:
            pickles = sorted(n for n in os.listdir(self.path) if n.endswith(PICKLE_SUFFIXES))
            if pickles:
                raise UnsupportedError(
                    f"{os.path.join(self.path, pickles[0])}: pickle weights are never loaded (they can run "
                    "code); re-save the model as safetensors (save_pretrained(..., safe_serialization=True))"
                )
            raise InputNotFoundError(f"{self.path}: no *.safetensors weights found")
        for name in names:
            shard = SafetensorsFile(check_inside(self.path, os.path.join(self.path, name)))
            self.files[name] = shard
            for key in shard.keys():
                if key in self._where:
                    raise CorruptFileError(
                        f"{shard.path}: tensor {key!r} also appears in {self._where[key]}; remove the duplicate file"
                    )
                self._where[key] = name

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def file_of(self, key: str) -> SafetensorsFile:
        return self.files[self._where[key]]

    def info(self, key: str) -> TensorInfo:
        return self.file_of(key).info(key)

    def array(self, key: str):
        return self.file_of(key).array(key)

    def mapped(self, key: str):
        """Tensor ``key`` over its file mapped into memory (:meth:`SafetensorsFile.mapped`)."""
        return self.file_of(key).mapped(key)

    def asset_files(self) -> list[str]:
        """Top-level non-weight files other than config.json (tokenizer, chat template, ...)."""
        return non_weight_files(self.path)

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self) -> HFModelDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def copy_assets(names: list[str], src_dir: str, dst_dir: str) -> None:
    """Copy the files ``names`` from ``src_dir`` to ``dst_dir`` (either may be on Cloud Storage)."""
    if storage.is_remote(src_dir) or storage.is_remote(dst_dir):
        for name in names:
            storage.write_bytes(storage.join(dst_dir, name), storage.read_bytes(storage.join(src_dir, name)))
        return
    os.makedirs(dst_dir, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))


def non_weight_files(directory: str) -> list[str]:
    """Top-level regular files of ``directory`` that are neither weights nor config.json (links
    only into the directory itself or, in a Hub cache snapshot, into its repository's blobs)."""
    if storage.is_remote(directory):
        return [n for n in sorted(storage.listdir(directory))
                if n != "config.json" and not n.startswith(".") and not is_weight_file(n)
                and storage.isfile(storage.join(directory, n))]
    return [n for n in sorted(os.listdir(directory))
            if n != "config.json" and not n.startswith(".") and not is_weight_file(n)
            and os.path.isfile(os.path.join(directory, n)) and _link_kept(directory, n)]


def _link_kept(directory: str, name: str) -> bool:
    try:
        check_inside(directory, os.path.join(directory, name))
    except CorruptFileError:
        return False
    return True


def write_model_directory(dst: str, tensors: list, hf_config: dict, max_shard_bytes: int, *,
                          assets_from: str | None = None, card: str | None = None, overwrite: bool = False,
                          desc: str = "write", progress: bool | None = None) -> list[str]:
    """Write an HF model directory atomically: sharded safetensors (+ index), config.json, the
    non-weight files of ``assets_from`` and, when given, ``card`` as its README.md (in place of
    one copied). ``tensors`` are PlannedTensors. Returns the weight files."""
    from ckptbridge.io.atomic import atomic_directory
    from ckptbridge.io.safetensors import write_sharded
    from ckptbridge.progress import Progress

    bar = Progress(sum(t.nbytes for t in tensors), desc, enabled=progress)
    with atomic_directory(dst, overwrite) as tmp:
        os.makedirs(tmp)
        files = write_sharded(tmp, tensors, max_shard_bytes, on_tensor=lambda t: bar.update(t.nbytes))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
            f.write("\n")
        if assets_from:
            copy_assets(non_weight_files(assets_from), assets_from, tmp)
        if card is not None:
            with open(os.path.join(tmp, "README.md"), "w") as f:
                f.write(card)
    bar.close()
    return files
