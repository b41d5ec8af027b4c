"""What the quantized-checkpoint tests share: three small random models (Llama with GQA, Qwen3 with q/k
norms and a head_dim of its own, Qwen2 with q/k/v biases), the prompt they score, and the comparison of
tokenmill's prompt log-probabilities with a reference model's logits."""

from __future__ import annotations

import torch
import transformers

from tokenmill import LLM, SamplingParams

PROMPT = [3, 17, 250, 9, 41, 77, 128, 5, 64, 200, 33, 1]
CONFIGS = {
    "llama": transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False,
    ),
    "qwen3": transformers.Qwen3Config(
        hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=32, vocab_size=256, tie_word_embeddings=False,
    ),
    # q, k and v with biases beside their quantized weights.
    "qwen2": transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False,
    ),
}  # fmt: skip
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3-ragged": "Qwen3ForCausalLM", "llama-tied": "LlamaForCausalLM",
}  # fmt: skip


# Shapes for one test each: rows not a multiple of 8 (an MLP 100 wide; one KV head of 20 dims); a head
# tied to the embedding.
AWKWARD_CONFIGS = {
    "qwen3-ragged": transformers.Qwen3Config(
        hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=20, vocab_size=256, tie_word_embeddings=False,
    ),
    "llama-tied": transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
    ),
}  # fmt: skip


def model_config(arch: str) -> transformers.PretrainedConfig:
    return CONFIGS.get(arch) or AWKWARD_CONFIGS[arch]


def random_model(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(model_config(arch), dtype=torch.float32).eval()


def load(path, **options) -> LLM:
    """The checkpoint at `path` on the CPU's reference path, whose arithmetic is the library's fake-quantized
    forward's. On CUDA the kernels differ by design (decode-sized batches skip FP8 activation quantization,
    W8A16); the tests marked gpu check them, with the tolerance that asks for."""
    defaults = dict(
        skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16, max_model_len=64, device="cpu"
    )
    return LLM(str(path), **{**defaults, **options})


def assert_config_change_refused(path, change: dict, message: str) -> None:
    """The checkpoint at `path` with `change` merged into its config.json's quantization_config fails to
    load with a ValueError matching `message`."""
    import json

    import pytest

    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load(path)


def prompt_logprobs_match(llm: LLM, logits: torch.Tensor, atol: float = 2e-3) -> None:
    """tokenmill's log-probability of each prompt token equals the reference logits' log-softmax."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    got = torch.tensor([entry[t].logprob for t, entry in zip(PROMPT[1:], out.prompt_logprobs[1:])])
    want = torch.log_softmax(logits.double(), dim=-1)[torch.arange(len(PROMPT) - 1), PROMPT[1:]]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)
