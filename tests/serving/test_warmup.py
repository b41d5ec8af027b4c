"""Start-up warm-up (run on GPUs only) leaves no trace: every block free, no prefix cache, zeroed counters,
and the same greedy tokens afterwards. Run here on the CPU path, which executes the same requests."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.serving.engine_setup import create_engine
from tokenmill.serving.llm_engine import LLMEngine
from tokenmill.serving.warmup import warm_up


def greedy(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request("probe", prompt, SamplingParams(max_tokens=6, temperature=0.0))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return output.outputs[0].token_ids
    raise AssertionError("no output")


def test_warm_up_leaves_no_trace(hf_model_dirs):
    path, _ = hf_model_dirs["qwen3"]
    config = EngineConfig(model=path, skip_tokenizer_init=True, max_model_len=512, num_kv_blocks=96)
    engine = LLMEngine(config)
    prompt = list(range(10, 60))
    before = greedy(engine, prompt)
    engine.scheduler.kv.reset_prefix_cache()
    parts = create_engine(config)
    warm_up(parts)
    kv, scheduler = parts.core.scheduler.kv, parts.core.scheduler
    assert not scheduler.has_unfinished_requests()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert kv.prefix_cache_queries == kv.prefix_cache_hits == 0 and kv.usage == 0
    engine.core = parts.core
    assert greedy(engine, prompt) == before
    assert kv.prefix_cache_hits == 0  # nothing the warm-up computed is served from the cache


def test_warm_up_of_a_pooling_engine(hf_model_dirs):
    path, _ = hf_model_dirs["llama"]
    parts = create_engine(EngineConfig(model=path, runner="pooling", max_model_len=300, num_kv_blocks=64))
    warm_up(parts)
    assert parts.core.scheduler.kv.pool.num_free_blocks == 64


def test_warm_up_meets_each_row_class_with_and_without_a_multiple_of_16() -> None:
    """Triton specialises an integer argument on whether it is 1 or a multiple of 16, and the kernels pick
    tiles by classes of rows (up to 16, 32, 64 and 128 rows a program, then powers of two): start-up meets
    each class up to a full step both ways, or a prompt's GEMMs compile on its path (a 128-token prompt
    compiled three INT4 tensor-core variants on the H200 before 32, 64 and 128 were among them)."""
    from tokenmill.serving.warmup import _WARMUP_LENGTHS

    bounds = [1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    for low, high in zip(bounds, bounds[1:]):
        lengths = [n for n in _WARMUP_LENGTHS if low < n <= high]
        assert any(n % 16 == 0 for n in lengths), (low, high)
        assert any(n % 16 for n in lengths), (low, high)
