"""The CPU tier of the prefix cache end to end on the embedded SmolLM2 (fp32): a device pool too small for
the working set, so conversations' blocks are evicted to the host and loaded back on their next turn.
Greedy tokens equal a run with a pool that holds everything; the tier reports hits, and the tokens it
served were not computed."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("async_scheduling", [False, True])
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


@pytest.mark.parametrize("async_scheduling", [False, True])
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
