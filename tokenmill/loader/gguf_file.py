"""Opening a GGUF model, one file or every shard of a split one, with look-ups of its metadata whose
errors name the file."""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np

_MISSING = object()


def open_gguf(path: str) -> GGUFFile:
    path = first_shard(path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist.")
    return _open_unchanged(path, *file_identity(path))


# llama.cpp's gguf-split names shard i of n `<prefix>-0000i-of-0000n.gguf`; the first holds the metadata.
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def first_shard(path: str) -> str:
    """The first shard of a split GGUF model, whichever shard `path` names; any other path as it is."""
    match = _SHARD_NAME.match(path)
    if match is None:
        return path
    return f"{match['prefix']}-00001-of-{match['count']}.gguf"


# Parsing the metadata of a 49k-token vocabulary takes seconds, and an engine start reads the config,
# the weights and the tokenizer of the same file in turn; a rewritten file has a new mtime and size.
@functools.lru_cache(maxsize=2)
def _open_unchanged(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def file_identity(path: str) -> list[int]:
    """What tells a rewritten file from the one read before: its size and modification time."""
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns]


def _read(path: str) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    # The reader reports a truncated or foreign file through whichever numpy error it hits first.
    except Exception as exc:
        raise ValueError(f"{path!r} is not a readable GGUF file ({exc}).") from exc


class GGUFFile:
    """An opened GGUF model (one file, or every shard of a split one): the first file's metadata, the
    tensors of all, and look-ups whose errors name the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reader = _read(path)
        self.shards = [path, *self._other_shards()]
        readers = [self.reader] + [_read(shard) for shard in self.shards[1:]]
        self.tensors = {tensor.name: tensor for reader in readers for tensor in reader.tensors}
        # Which shard holds each tensor (an index into `shards`).
        self.shard_of = {tensor.name: i for i, reader in enumerate(readers) for tensor in reader.tensors}
        expected = self.get("split.tensors.count", len(self.tensors))
        if len(self.tensors) != expected:
            raise self.error(f"its shards hold {len(self.tensors)} tensors, not the {expected} it states.")
        self.architecture: str = self.get("general.architecture")

    def _other_shards(self) -> list[str]:
        count = self.get("split.count", 1)
        if count <= 1:
            return []
        match = _SHARD_NAME.match(self.path)
        if match is None or int(match["count"]) != count:
            raise self.error(
                f"it is the first of {count} shards but not named <name>-00001-of-{count:05d}.gguf, so "
                "the others cannot be found."
            )
        shards = [f"{match['prefix']}-{index:05d}-of-{count:05d}.gguf" for index in range(2, count + 1)]
        missing = [shard for shard in shards if not os.path.isfile(shard)]
        if missing:
            raise self.error(f"its shard {missing[0]!r} does not exist.")
        return shards

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise self.error(f"the metadata key {key!r} is missing.")
            return default
        return field.contents()

    def arch_get(self, key: str, default: Any = _MISSING) -> Any:
        """A model hyperparameter, stored under the architecture's own prefix."""
        return self.get(f"{self.architecture}.{key}", default)

    def layer_get(self, key: str, default: Any = _MISSING) -> Any:
        """A hyperparameter llama.cpp lets a file state per layer (as an array): one value for all."""
        value = self.arch_get(key, default)
        if not isinstance(value, list):
            return value
        if len(set(value)) != 1:
            raise self.error(
                f"{self.architecture}.{key} differs between layers ({value}); only one value for every "
                "layer is supported."
            )
        return value[0]

    def error(self, message: str) -> ValueError:
        return ValueError(f"GGUF file {self.path!r}: {message}")


class GGUFTensorTable:
    """Where each tensor of a GGUF model lies (its shard, name, ggml type, and the byte range, dtype and
    shape of its data), without the metadata: an engine start that reads the weights of a file whose
    config and tokenizer are cached need not parse a 49k-token vocabulary again (2-3 s of every engine
    process on the CI machine). Built from an opened file and saved as JSON beside the cached config."""

    FILENAME = "tensors.json"

    def __init__(
        self, path: str, architecture: str, shards: list[dict[str, Any]], entries: list[dict[str, Any]]
    ) -> None:
        self.path = path
        self.architecture = architecture
        # Every file's name and identity (size, modification time), the first one's directory holding all.
        self.shards = shards
        self.entries = entries

    @classmethod
    def of(cls, file: GGUFFile) -> GGUFTensorTable:
        entries = []
        for tensor in file.tensors.values():
            entries.append(
                {
                    "shard": file.shard_of[tensor.name],
                    "name": tensor.name,
                    "type": int(tensor.tensor_type),
                    "offset": int(tensor.data_offset),
                    "dtype": tensor.data.dtype.str,
                    "shape": list(tensor.data.shape),
                }
            )
        shards = [{"name": os.path.basename(f), "identity": file_identity(f)} for f in file.shards]
        return cls(file.path, file.architecture, shards, entries)

    def save_pretrained(self, directory: str) -> None:
        """Written as the cache writes a config or tokenizer (a directory per kind)."""
        os.makedirs(directory, exist_ok=True)
        table = {"architecture": self.architecture, "shards": self.shards, "tensors": self.entries}
        with open(os.path.join(directory, self.FILENAME), "w") as handle:
            json.dump(table, handle)

    @classmethod
    def load(cls, path: str, directory: str) -> GGUFTensorTable:
        """The table of the file at `path` saved in a cache directory; a ValueError if unreadable or if a
        shard changed since (the cache is keyed by the first file alone)."""
        try:
            with open(os.path.join(directory, cls.FILENAME)) as handle:
                table = json.load(handle)
            shards = table["shards"]
            for shard in shards:
                if file_identity(os.path.join(os.path.dirname(path), shard["name"])) != shard["identity"]:
                    raise ValueError(f"shard {shard['name']!r} changed since its table was saved")
            return cls(path, table["architecture"], shards, table["tensors"])
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"unreadable tensor table ({exc!r})") from exc

    def tensors(self) -> Iterator[tuple[str, gguf.GGMLQuantizationType, np.ndarray]]:
        """Each tensor's name, type and data: a read-only view of the memory-mapped file, as the reader
        gives it."""
        directory = os.path.dirname(self.path)
        maps = [np.memmap(os.path.join(directory, shard["name"]), mode="r") for shard in self.shards]
        for entry in self.entries:
            dtype = np.dtype(entry["dtype"])
            count = int(np.prod(entry["shape"], dtype=np.int64))
            start = entry["offset"]
            data = maps[entry["shard"]][start : start + count * dtype.itemsize]
            data = data.view(dtype).reshape(entry["shape"])
            yield entry["name"], gguf.GGMLQuantizationType(entry["type"]), data

    def error(self, message: str) -> ValueError:
        return ValueError(f"GGUF file {self.path!r}: {message}")
