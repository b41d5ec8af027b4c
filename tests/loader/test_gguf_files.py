"""GGUF models as outside users hand them over: split into shards, per-layer metadata arrays, tensors
missing; each loads as the model it came from or fails with a ValueError naming the file and the fault."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tokenmill.loader import gguf_file, resolve_model
from tokenmill.loader.gguf import iter_gguf_weights, load_gguf_config

WriteGGUF = Callable[..., None]  # conftest.write_gguf

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TINY |= dict(num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(**TINY, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("shard", [1, 3])
def test_split_model_loads_whole_from_any_shard(
    tmp_path: Path, write_gguf: WriteGGUF, llama: torch.nn.Module, shard: int
) -> None:
    write_gguf(tmp_path / "model.gguf", llama, gguf.MODEL_ARCH.LLAMA, split_max_tensors=8)
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == [f"model-0000{index}-of-00003.gguf" for index in (1, 2, 3)]
    path = str(tmp_path / names[shard - 1])

    assert load_gguf_config(path).num_hidden_layers == 2
    weights = dict(iter_gguf_weights(path))
    assert len(weights) == len(llama.state_dict()) == 21
    assert torch.equal(
        weights["model.layers.1.mlp.down_proj.weight"],
        llama.state_dict()["model.layers.1.mlp.down_proj.weight"],
    )


def test_tensor_table_from_the_cache_reads_no_metadata(
    tmp_path: Path, write_gguf: WriteGGUF, llama: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    write_gguf(folder / "model.gguf", llama, gguf.MODEL_ARCH.LLAMA, split_max_tensors=8)
    path = str(folder / "model-00002-of-00003.gguf")
    first = dict(iter_gguf_weights(path))

    # The second start parses no file: the config and the tensor table come from the cache.
    def no_parse(path: str) -> None:
        raise AssertionError(f"{path} parsed again")

    monkeypatch.setattr(gguf_file, "_read", no_parse)
    gguf_file._open_unchanged.cache_clear()
    cached = dict(iter_gguf_weights(path))
    assert cached.keys() == first.keys() == llama.state_dict().keys()
    for name, weights in llama.state_dict().items():
        assert torch.equal(cached[name], weights), name

    # A later shard rewritten (the cache is keyed by the first): its table is refused, the files read again.
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    llama_changed = AutoModelForCausalLM.from_config(llama.config, dtype=torch.float32).eval()
    write_gguf(tmp_path / "model.gguf", llama_changed, gguf.MODEL_ARCH.LLAMA, split_max_tensors=8)
    shard = folder / "model-00003-of-00003.gguf"
    (tmp_path / "model-00003-of-00003.gguf").replace(shard)
    first_shard_stat = (folder / "model-00001-of-00003.gguf").stat()
    os.utime(shard, ns=(first_shard_stat.st_atime_ns, first_shard_stat.st_mtime_ns + 10**9))
    rewritten = dict(iter_gguf_weights(path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh cache"))
    fresh = dict(iter_gguf_weights(path))
    changed = [name for name in fresh if not torch.equal(fresh[name], first[name])]
    assert changed and all(torch.equal(rewritten[name], fresh[name]) for name in fresh)


def test_tensor_table_of_the_embedded_quantized_model(tmp_path: Path) -> None:
    """Q4_1 and Q8_0 tensors (bytes by rows) come out of the table, as saved in the cache and read back,
    as the reader lays them out."""
    path = resolve_model("default").path
    # The package's reader as the reference: the one open_gguf holds (parsing the 49k-token vocabulary
    # again would take seconds on its own).
    file = gguf_file.open_gguf(path)
    reader = file.reader
    assert isinstance(reader, gguf.GGUFReader)
    gguf_file.GGUFTensorTable.of(file).save_pretrained(str(tmp_path))
    table = gguf_file.GGUFTensorTable.load(path, str(tmp_path))
    read = list(table.tensors())
    assert [name for name, _, _ in read] == [tensor.name for tensor in reader.tensors]
    for (name, tensor_type, data), tensor in zip(read, reader.tensors, strict=True):
        assert tensor_type == tensor.tensor_type, name
        assert data.dtype == tensor.data.dtype and data.shape == tensor.data.shape, name
        assert np.array_equal(data, tensor.data), name


def test_split_model_with_a_shard_missing(
    tmp_path: Path, write_gguf: WriteGGUF, llama: torch.nn.Module
) -> None:
    write_gguf(tmp_path / "model.gguf", llama, gguf.MODEL_ARCH.LLAMA, split_max_tensors=8)
    (tmp_path / "model-00002-of-00003.gguf").unlink()
    with pytest.raises(ValueError, match=r"model-00001-of-00003.gguf.*shard '.*model-00002-of-00003.gguf'"):
        load_gguf_config(str(tmp_path / "model-00001-of-00003.gguf"))


def test_split_shard_renamed_away_from_the_pattern(
    tmp_path: Path, write_gguf: WriteGGUF, llama: torch.nn.Module
) -> None:
    write_gguf(tmp_path / "model.gguf", llama, gguf.MODEL_ARCH.LLAMA, split_max_tensors=8)
    renamed = tmp_path / "first.gguf"
    (tmp_path / "model-00001-of-00003.gguf").rename(renamed)
    with pytest.raises(ValueError, match=r"first.gguf.*first of 3 shards"):
        load_gguf_config(str(renamed))


def _head_count_kv_array(values: list[int]) -> Callable[[gguf.GGUFWriter], None]:
    def extra(writer: gguf.GGUFWriter) -> None:
        # The key write_gguf already wrote as a number, replaced by the per-layer array llama.cpp allows.
        key = gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=writer.arch)
        del writer.kv_data[0][key]
        writer.add_array(key, values)

    return extra


def test_per_layer_head_counts(tmp_path: Path, write_gguf: WriteGGUF, llama: torch.nn.Module) -> None:
    uniform = tmp_path / "uniform.gguf"
    write_gguf(uniform, llama, gguf.MODEL_ARCH.LLAMA, _head_count_kv_array([2, 2]))
    assert load_gguf_config(str(uniform)).num_key_value_heads == 2

    varying = tmp_path / "varying.gguf"
    write_gguf(varying, llama, gguf.MODEL_ARCH.LLAMA, _head_count_kv_array([2, 1]))
    with pytest.raises(ValueError, match=r"varying.gguf.*head_count_kv differs between layers \(\[2, 1\]\)"):
        load_gguf_config(str(varying))


@pytest.mark.parametrize(
    ("skipped", "gguf_name"),
    [
        ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
        ("model.embed_tokens.weight", "token_embd.weight"),
    ],
)
def test_missing_tensor_is_named(
    tmp_path: Path, write_gguf: WriteGGUF, llama: torch.nn.Module, skipped: str, gguf_name: str
) -> None:
    path = tmp_path / "incomplete.gguf"
    write_gguf(path, llama, gguf.MODEL_ARCH.LLAMA, skip_tensors=(skipped,))
    for load in (load_gguf_config, iter_gguf_weights):
        with pytest.raises(ValueError, match=rf"incomplete.gguf.*tensor '{gguf_name}' is missing"):
            load(str(path))


def test_a_tensor_with_no_counterpart_is_named(
    tmp_path: Path, write_gguf: WriteGGUF, llama: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def extra(writer: gguf.GGUFWriter) -> None:
        writer.add_tensor("blk.0.attn_sinks.weight", np.zeros(4, dtype=np.float32))

    path = tmp_path / "extra.gguf"
    write_gguf(path, llama, gguf.MODEL_ARCH.LLAMA, extra)
    with pytest.raises(ValueError, match=r"extra.gguf.*'blk.0.attn_sinks.weight' has no counterpart"):
        dict(iter_gguf_weights(str(path)))


def test_directory_holding_a_gguf_model(
    tmp_path: Path, write_gguf: WriteGGUF, llama: torch.nn.Module
) -> None:
    single = tmp_path / "single"
    single.mkdir()
    write_gguf(single / "model-Q8_0.gguf", llama, gguf.MODEL_ARCH.LLAMA)
    source = resolve_model(str(single))
    assert (source.format, source.path, source.tokenizer_path) == (
        "gguf",
        str(single / "model-Q8_0.gguf"),
        None,
    )
    assert len(dict(source.iter_weights())) == 21

    # A config.json and the original tokenizer beside the GGUF: the GGUF's config, the directory's tokenizer.
    llama.config.save_pretrained(single)
    (single / "tokenizer.json").write_text("{}")
    source = resolve_model(str(single))
    assert (source.format, source.tokenizer_path) == ("gguf", str(single))
    assert resolve_model(str(single), tokenizer="other").tokenizer_path == "other"

    split = tmp_path / "split"
    split.mkdir()
    write_gguf(split / "model.gguf", llama, gguf.MODEL_ARCH.LLAMA, split_max_tensors=8)
    assert resolve_model(str(split)).path == str(split / "model-00001-of-00003.gguf")

    write_gguf(split / "other.gguf", llama, gguf.MODEL_ARCH.LLAMA)
    with pytest.raises(
        ValueError, match=r"holds several GGUF models \(model-00001-of-00003.gguf, other.gguf\)"
    ):
        resolve_model(str(split))


def test_the_cache_drops_entries_of_files_gone_or_rewritten(
    tmp_path: Path, write_gguf: WriteGGUF, llama: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each converted file's cache entry records its source; writing a new entry removes those whose file
    is gone or was rewritten since (their key can never be looked up again), and keeps the rest."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "tokenmill" / "gguf"
    paths = {name: tmp_path / f"{name}.gguf" for name in ("kept", "gone", "rewritten", "new")}
    for name in ("kept", "gone", "rewritten"):
        write_gguf(paths[name], llama, gguf.MODEL_ARCH.LLAMA)
        load_gguf_config(str(paths[name]))
    entries = {path.name.rsplit("-", 1)[0]: path for path in root.iterdir()}
    assert sorted(entries) == ["gone", "kept", "rewritten"]
    paths["gone"].unlink()
    stat = paths["rewritten"].stat()
    os.utime(paths["rewritten"], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    load_gguf_config(str(paths["kept"]))  # (from the cache: no new entry, nothing pruned)
    assert len(list(root.iterdir())) == 3
    write_gguf(paths["new"], llama, gguf.MODEL_ARCH.LLAMA)
    load_gguf_config(str(paths["new"]))
    assert sorted(path.name.rsplit("-", 1)[0] for path in root.iterdir()) == ["kept", "new"]
    assert entries["kept"].is_dir() and (entries["kept"] / "config").is_dir()
