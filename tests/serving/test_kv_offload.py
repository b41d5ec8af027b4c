"""The CPU tier of the prefix cache end to end on the embedded SmolLM2 (fp32): a device pool too small for
the working set, so conversations' blocks are evicted to the host and loaded back on their next turn.
Greedy tokens equal a run with a pool that holds everything; the tier reports hits, and the tokens it
served were not computed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams

# Four conversations of ~200-token system prompts, visited in turn: each comes back after the other three
# have gone through a device pool that holds about two of them.
SYSTEMS = [
    f"System {n}: " + " ".join(f"fact {n}-{k} is that the value {k * 7 + n} matters." for k in range(22))
    for n in range(4)
]
PARAMS = SamplingParams(max_tokens=8, temperature=0)


def run(llm: LLM, rounds: int = 2) -> list[str]:
    texts = []
    for turn in range(rounds):
        for n, system in enumerate(SYSTEMS):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Q{turn}.{n}?"}]
            texts.append(llm.chat([messages], PARAMS, use_tqdm=False)[0].outputs[0].text)
    return texts


@pytest.fixture(scope="module")
def reference() -> list[str]:
    return run(LLM("default", dtype="float32", max_model_len=512, num_kv_blocks=200))


# Each tier under both loops; the default suite runs the CPU tier under the synchronous loop and the disk
# tier under the asynchronous one (the other two pairs, ~20 s of the suite's two cores, are marked slow).
SLOW = pytest.mark.slow


@pytest.mark.parametrize("async_scheduling", [False, pytest.param(True, marks=SLOW)])
def test_offloaded_prefixes_come_back_with_the_same_tokens(reference, async_scheduling) -> None:
    llm = LLM(
        "default", dtype="float32", max_model_len=512, num_kv_blocks=40, kv_offload_gib=0.1,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    kv = llm.engine.scheduler.kv
    assert kv.host is not None and llm.engine.runner.host_kv is not None
    assert run(llm) == reference
    # Second round: each system prompt (~14 full blocks) came back from the host, not recomputed.
    assert kv.host.num_saved > 0 and kv.host.num_loaded >= 4 * 12
    assert kv.offload_hits >= kv.host.num_loaded * 16 - 16
    host_kv = llm.engine.runner.host_kv
    assert host_kv.bytes_loaded == kv.host.num_loaded * host_kv.block_bytes
    assert kv.prefix_cache_hits < kv.offload_hits  # without the tier these tokens were recomputed


def test_bad_offload_sizes_name_the_knob() -> None:
    with pytest.raises(ValueError, match="kv_offload_gib"):
        LLM("default", kv_offload_gib=-1)
    with pytest.raises(ValueError, match="kv_offload_gib"):
        LLM("default", kv_offload_gib=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_gib"):
        LLM("default", dtype="float32", max_model_len=512, num_kv_blocks=40, kv_offload_gib=1e-9)


@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=SLOW), True])
def test_the_disk_tier_behind_a_small_cpu_tier_gives_the_same_tokens(
    reference, tmp_path, async_scheduling
) -> None:
    """A CPU tier of about one conversation in front of a disk tier: blocks go device -> host -> disk and
    come back disk -> host -> device, with the same greedy tokens; the file is gone with the engine. (The
    host takes at most its own size of a step's evictions: the CPU tier must hold one step's worth.)"""
    llm = LLM(
        "default", dtype="float32", max_model_len=512, num_kv_blocks=40, kv_offload_gib=0.016,
        kv_offload_disk=str(tmp_path), kv_offload_disk_gib=0.2, async_scheduling=async_scheduling,
    )  # fmt: skip
    kv, host_kv = llm.engine.scheduler.kv, llm.engine.runner.host_kv
    assert kv.host is not None and kv.host.disk is not None and host_kv is not None
    assert kv.host.num_blocks < 2 * 21  # two conversations do not fit on the host
    assert run(llm) == reference
    disk = kv.host.disk
    assert disk.num_spilled > 0 and disk.num_read >= 4 * 6 and kv.disk_hits >= disk.num_read * 16 - 16
    assert host_kv.bytes_read == disk.num_read * host_kv.block_bytes
    assert host_kv.bytes_spilled == disk.num_spilled * host_kv.block_bytes
    assert kv.prefix_cache_hits < kv.offload_hits
    assert not list(tmp_path.iterdir())  # an unlinked file: nothing to clean up


def test_bad_disk_tier_knobs_name_them(tmp_path) -> None:
    with pytest.raises(ValueError, match="kv_offload_disk"):
        LLM("default", kv_offload_disk=str(tmp_path), kv_offload_disk_gib=1)  # no CPU tier
    with pytest.raises(ValueError, match="kv_offload_disk_gib"):
        LLM("default", kv_offload_gib=1, kv_offload_disk=str(tmp_path))
    with pytest.raises(ValueError, match="kv_offload_disk"):
        LLM("default", kv_offload_gib=1, kv_offload_disk=str(tmp_path / "missing"), kv_offload_disk_gib=1)
    with pytest.raises(ValueError, match="kv_offload_disk_gib"):
        LLM("default", kv_offload_gib=1, kv_offload_disk_gib=1)


NEEDS_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_offloaded_prefixes_of_batched_requests(hf_model_dirs, device, async_scheduling) -> None:
    """A random-weight Llama on token ids, two requests a step (on a GPU in bf16, where the pool's copies
    run on their own streams): four 160-token prefixes through a pool that holds about two, each visited
    three times with a new suffix; greedy tokens equal a pool that holds everything."""
    path, _ = hf_model_dirs["llama"]
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(3, 1000, 160).tolist() for _ in range(4)]
    lens = [8, 12, 16, 20]
    rounds = [[p + rng.integers(3, 1000, n).tolist() for p, n in zip(prefixes, lens)] for _ in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def tokens(**pool) -> tuple[list[list[int]], LLM]:
        llm = LLM(
            path, skip_tokenizer_init=True, dtype="bfloat16" if device == "cuda" else "float32",
            device=device, max_model_len=256, block_size=16, async_scheduling=async_scheduling, **pool,
        )  # fmt: skip
        out = []
        for prompts in rounds:  # two at a time: loads and saves share steps with other requests' work
            for pair in (prompts[:2], prompts[2:]):
                outputs = llm.generate(prompt_token_ids=pair, sampling_params=params, use_tqdm=False)
                out += [o.outputs[0].token_ids for o in outputs]
        return out, llm

    reference, _ = tokens(num_kv_blocks=200)
    offloaded, llm = tokens(num_kv_blocks=26, kv_offload_gib=0.01)
    kv = llm.engine.scheduler.kv
    assert offloaded == reference
    assert kv.host.num_saved > 0 and kv.host.num_loaded >= 2 * 4 * 9  # rounds 2 and 3 loaded most prefixes
