"""GPTQ and AWQ 4-bit checkpoints written from their published layouts (the packers below follow the
formats' specs; the libraries themselves need CUDA builds this machine lacks), loaded by tokenmill and
compared with the same model whose linear weights are the dequantized values."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.layers.linear import LinearBase

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
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
}  # fmt: skip


def to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight: [K, N] 4-bit values, eight rows to a word, row 8r + j in bits 4j -> [K/8, N]."""
    v = values.long().reshape(-1, 8, values.shape[1])
    return to_int32(sum(v[:, j] << (4 * j) for j in range(8)))


def pack_columns(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[R, C] -> [R, C/8]: nibble j of word c holds column 8c + order[j]."""
    v = values.long().reshape(values.shape[0], -1, 8)
    return to_int32(sum(v[:, :, order[j]] << (4 * j) for j in range(8)))


def make_checkpoint(arch: str, method: str, group: int, path) -> torch.Tensor:
    """Quantize a random model's linears (round-to-nearest, asymmetric groups), save the GPTQ or AWQ
    tensors; returns the logits of the model with the dequantized weights."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch], dtype=torch.float32).eval()
    tensors = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        w = module.weight.data  # [N, K]
        n, k = w.shape
        groups = w.t().reshape(k // group, group, n)  # [G, group, N]
        lo, hi = groups.amin(1), groups.amax(1)
        scale = ((hi - lo) / 15).clamp(min=1e-8).half()
        zero = torch.round(-lo / scale.float()).clamp(1, 15)  # GPTQ stores zero - 1: keep zero >= 1
        q = torch.round(groups / scale.float()[:, None] + zero[:, None]).clamp(0, 15)  # [G, group, N]
        dequantized = (q - zero[:, None]) * scale.float()[:, None]
        module.weight.data = dequantized.reshape(k, n).t().contiguous()
        q = q.reshape(k, n)
        if method == "gptq":
            tensors[f"{name}.qweight"] = pack_rows(q)
            tensors[f"{name}.qzeros"] = pack_columns(zero - 1, tuple(range(8)))
            tensors[f"{name}.g_idx"] = torch.arange(k, dtype=torch.int32) // group
        else:
            tensors[f"{name}.qweight"] = pack_columns(q, AWQ_ORDER)
            tensors[f"{name}.qzeros"] = pack_columns(zero, AWQ_ORDER)
        tensors[f"{name}.scales"] = scale
    for name, param in model.named_parameters():
        if not any(name.startswith(prefix) for prefix in {n.rsplit(".", 1)[0] + "." for n in tensors}):
            tensors[name] = param.data.contiguous()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    save_file(tensors, str(path / "model.safetensors"))
    config = CONFIGS[arch].to_dict()
    quantization = {"quant_method": method, "bits": 4, "group_size": group}
    quantization.update(
        {"desc_act": False, "sym": False} if method == "gptq" else {"zero_point": True, "version": "gemm"}
    )
    config["quantization_config"] = quantization
    config["architectures"] = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    (path / "config.json").write_text(json.dumps(config))
    return logits


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_logprobs_match_the_dequantized_model(arch: str, method: str, tmp_path) -> None:
    logits = make_checkpoint(arch, method, 32, tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16, max_model_len=64)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.qweight.dtype == torch.int32 for m in linears)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    got = torch.tensor([entry[t].logprob for t, entry in zip(PROMPT[1:], out.prompt_logprobs[1:])])
    want = torch.log_softmax(logits.double(), dim=-1)[torch.arange(len(PROMPT) - 1), PROMPT[1:]]
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 8}, "bits 8 is not supported"),
        ({"desc_act": True}, "desc_act true"),
        ({"checkpoint_format": "gptq_v2"}, "checkpoint_format 'gptq_v2'"),
    ],
)
def test_unsupported_gptq_variants_name_the_field(change: dict, message: str, tmp_path) -> None:
    make_checkpoint("llama", "gptq", 32, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16, max_model_len=64)
