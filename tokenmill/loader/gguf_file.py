"""Opening a GGUF model, one file or every shard of a split one, with look-ups of its metadata whose
errors name the file."""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import gguf

_MISSING = object()


def open_gguf(path: str) -> GGUFFile:
    path = first_shard(path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist.")
    stat = os.stat(path)
    return _open_unchanged(path, stat.st_mtime_ns, stat.st_size)


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
def _open_unchanged(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


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
        readers = [self.reader] + [_read(shard) for shard in self._other_shards()]
        self.tensors = {tensor.name: tensor for reader in readers for tensor in reader.tensors}
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
