"""EAGLE-1 and EAGLE-3 heads from their published checkpoint layouts (random weights, written the way the
EAGLE repository and SpecForge write them): the engine's drafts are the ones a reference built from
transformers' own Llama modules computes over the target's hidden states, and greedy output is the
plain engine's, with chunked prefill, preemption, prefix hits and an abort."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from tests.models.test_llama_equivalence import make_llm, random_prompts
from tests.serving.test_async_scheduling import run
from tokenmill import SamplingParams

VOCAB = 1003
DRAFT_VOCAB = 300


def llama_config(num_layers: int, **extra) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=48,
        intermediate_size=200, num_hidden_layers=num_layers, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        tie_word_embeddings=False, **extra,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A six-layer Llama (EAGLE-3's default taps, 2, 3 and 3, need a few layers), fp32."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(6)).eval()
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    return str(path), model


class Eagle1Reference(nn.Module):
    """EAGLE-1 from transformers' modules: fc over [embedding, feature], a decoder layer without its
    input norm, the target's LM head."""

    def __init__(self, config: LlamaConfig, own_embedding: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embedding else None
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = LlamaDecoderLayer(config, 0)
        self.layer.input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)
        for p in self.parameters():
            nn.init.normal_(p, 0.0, 0.3)

    def checkpoint(self) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight, "fc.bias": self.fc.bias}
        out.update({f"layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        if self.embed_tokens is not None:
            out["embed_tokens.weight"] = self.embed_tokens.weight
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    def step(self, target, tokens, features):
        embed = self.embed_tokens or target.model.embed_tokens
        x = self.fc(torch.cat([embed(tokens), features], dim=-1))[None]
        out = _layer(self.layer, self.rotary, x)
        return out, out  # (to the LM head, next feature)

    def draft(self, target, hidden):
        return int(target.lm_head(hidden).argmax())


class Eagle3Reference(nn.Module):
    """EAGLE-3: fc over three target streams, attention over [norm(embedding), norm(feature)], its own
    final norm and LM head over a draft vocabulary mapped to the target's by d2t."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.attn = LlamaAttention(config, 0)
        heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.attn.q_proj = nn.Linear(2 * h, heads * d, bias=False)
        self.attn.k_proj = nn.Linear(2 * h, kv * d, bias=False)
        self.attn.v_proj = nn.Linear(2 * h, kv * d, bias=False)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.norm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, DRAFT_VOCAB, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        for p in self.parameters():
            nn.init.normal_(p, 0.0, 0.3)
        # Draft token i is target token d2t[i] + i: a sorted subset of the target's vocabulary.
        hot = torch.sort(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB])[0]
        self.d2t = hot - torch.arange(DRAFT_VOCAB)

    def checkpoint(self) -> dict[str, torch.Tensor]:
        out = {
            "fc.weight": self.fc.weight,
            "norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
        }
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            out[f"midlayer.{name}.weight"] = getattr(self, name).weight
        out.update({f"midlayer.self_attn.{k}": v for k, v in self.attn.state_dict().items()})
        out.update({f"midlayer.mlp.{k}": v for k, v in self.mlp.state_dict().items()})
        out = {k: v.detach().clone().contiguous() for k, v in out.items()}
        out["d2t"] = self.d2t.clone()
        out["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
        return out

    def step(self, target, tokens, features):
        x = torch.cat(
            [self.input_layernorm(target.model.embed_tokens(tokens)), self.hidden_norm(features)], -1
        )
        n = x.shape[0]
        positions = torch.arange(n)[None]
        attn_out, _ = self.attn(
            x[None], position_embeddings=self.rotary(x[None], positions), attention_mask=_causal(n)
        )
        h1 = attn_out[0] + features
        prenorm = self.mlp(self.post_attention_layernorm(h1)) + h1
        return self.norm(prenorm), prenorm

    def draft(self, target, hidden):
        index = int(self.lm_head(hidden).argmax())
        return index + int(self.d2t[index])


def _causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def _layer(layer, rotary, x):
    n = x.shape[1]
    positions = torch.arange(n)[None]
    out = layer(
        x, attention_mask=_causal(n), position_ids=positions, position_embeddings=rotary(x, positions)
    )
    return (out[0] if isinstance(out, tuple) else out)[0]


def target_features(model, tokens: list[int], taps: tuple[int, ...] | None) -> torch.Tensor:
    """The target's features at every position: its last hidden state (after the final norm), or the
    residual stream entering each of `taps` (the number of layers: leaving the last one) side by side."""
    seen = {}
    layers = model.model.layers
    hooks = [
        layer.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0][0]))
        for i, layer in enumerate(layers)
    ]

    def leaving(module, args, out) -> None:
        seen[len(layers)] = (out[0] if isinstance(out, tuple) else out)[0]

    hooks.append(layers[-1].register_forward_hook(leaving))
    try:
        out = model.model(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    if taps is None:
        return out.last_hidden_state[0]
    return torch.cat([seen[i] for i in taps], dim=-1)


@torch.no_grad()
def reference_drafts(head, model, tokens: list[int], k: int, taps) -> list[int]:
    """k greedy drafts after `tokens`, recomputed from scratch: row p reads token p + 1 and the target's
    feature at p (through fc for EAGLE-3); the rows after the known tokens read the previous draft and
    the head's own feature from the row before."""
    base = target_features(model, tokens, taps)[:-1]
    if taps is not None:
        base = head.fc(base)
    own = base[:0]
    rows = torch.tensor(tokens[1:])
    drafts = []
    for _ in range(k):
        hidden, features = head.step(model, rows, torch.cat([base, own]))
        drafts.append(head.draft(model, hidden[-1]))
        own = torch.cat([own, features[-1:]])
        rows = torch.cat([rows, torch.tensor([drafts[-1]])])
    return drafts


def write_head(path, kind: str) -> tuple[nn.Module, tuple[int, ...] | None]:
    """A random head at `path` in its published layout; returns its reference and the target layers it
    taps (None: the last hidden state)."""
    torch.manual_seed(7)
    if kind.startswith("eagle3"):
        extra = {"draft_vocab_size": DRAFT_VOCAB, "architectures": ["LlamaForCausalLMEagle3"]}
        taps = (2, 3, 3)  # 2, L // 2, L - 3 for six layers
        if kind == "eagle3-ids":  # outputs of layers 0, 2 and 5: the streams entering 1, 3 and after 5
            extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}
            taps = (1, 3, 6)
        config = llama_config(1, **extra)
        head = Eagle3Reference(config).eval()
        save_file(head.checkpoint(), str(path / "model.safetensors"))
    else:
        config = llama_config(1, architectures=["LlamaForCausalLM"])
        own_embedding = kind == "eagle-bin"
        head = Eagle1Reference(config, own_embedding).eval()
        if own_embedding:  # the EAGLE repository's format
            torch.save(head.checkpoint(), path / "pytorch_model.bin")
        else:
            save_file(head.checkpoint(), str(path / "model.safetensors"))
        taps = None
    config.save_pretrained(path)
    return head, taps


def spec_config(kind: str, path) -> dict:
    method = "eagle3" if kind.startswith("eagle3") else "eagle"
    return {"method": method, "num_speculative_tokens": 3, "model": str(path)}


def record_rounds(drafter) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, its drafts) for every proposal the drafter makes from now on."""
    rounds = []
    propose = drafter.propose

    def spy(req_ids, samples, wanted):
        drafts = propose(req_ids, samples, wanted)
        for request_id, row in zip(req_ids, drafts):
            if row:
                rounds.append((list(drafter.runner.input_batch.requests[request_id].all_token_ids), row))
        return drafts

    drafter.propose = spy
    return rounds


@pytest.mark.parametrize("kind", ["eagle-bin", "eagle", "eagle3", "eagle3-ids"])
def test_drafts_match_the_reference_head(kind, target, tmp_path) -> None:
    """Every round of drafts for two requests decoding together (the head's KV written over prompt
    chunks, accepted tokens and drafts): the reference's, recomputed from the request's tokens."""
    head, taps = write_head(tmp_path, kind)
    path, model = target
    llm = make_llm(path, block_size=4, max_model_len=128, max_num_batched_tokens=24,
                   speculative_config=spec_config(kind, tmp_path))  # fmt: skip
    rounds = record_rounds(llm.engine.runner.drafter)
    prompts = random_prompts([30, 9], seed=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert len(rounds) >= 4
    for tokens, drafts in rounds:
        assert drafts == reference_drafts(head, model, tokens, len(drafts), taps)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_output_is_unchanged(kind, target, tmp_path) -> None:
    """Chunked prefill, preemption, an abort, max_tokens inside the drafts, then the same prompts again
    over the prefix cache: the plain engine's greedy tokens, every block freed."""
    write_head(tmp_path, kind)
    path, _ = target
    prompts = random_prompts([5, 30, 17, 2, 21], seed=2)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 1, 25, 37, 23)]
    engine_args = dict(block_size=4, num_kv_blocks=34, max_num_batched_tokens=20, max_model_len=128)
    expected = run(make_llm(path, **engine_args), prompts, params, abort_at_step=4)
    spec = make_llm(path, **engine_args, speculative_config=spec_config(kind, tmp_path))
    assert run(spec, prompts, params, abort_at_step=4) == expected
    assert run(spec, prompts, params) == run(make_llm(path, **engine_args), prompts, params)
    scheduler = spec.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.spec.num_drafts > 0
    assert scheduler.kv.prefix_cache_hits > 0


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_async_scheduling_keeps_the_heads_features(kind, target, tmp_path) -> None:
    """Async scheduling launches a step before the last one's drafts are proposed (at a batch of
    disable_by_batch_size or more): the head still writes its KV from that step's own features, so the
    drafts after the batch shrinks are the reference's, and greedy tokens the plain engine's."""
    head, taps = write_head(tmp_path, kind)
    path, model = target
    prompts = random_prompts([5, 30, 17, 2, 21, 9], seed=2)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 3, 6, 8, 5, 34)]
    engine_args = dict(block_size=4, max_num_batched_tokens=24, max_model_len=128)
    expected = run(make_llm(path, **engine_args), prompts, params)
    config = {**spec_config(kind, tmp_path), "disable_by_batch_size": 3}
    spec = make_llm(path, **engine_args, async_scheduling=True, speculative_config=config)
    rounds = record_rounds(spec.engine.runner.drafter)
    assert run(spec, prompts, params) == expected
    assert rounds
    for tokens, drafts in rounds:
        assert drafts == reference_drafts(head, model, tokens, len(drafts), taps)


def test_bad_heads_are_named(target, tmp_path) -> None:
    path, _ = target
    with pytest.raises(ValueError, match="needs model"):
        make_llm(path, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not a directory with a config.json"):
        make_llm(
            path, speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path)}
        )
    write_head(tmp_path, "eagle3")
    config = spec_config("eagle3", tmp_path)
    weights = dict(__import__("safetensors.torch").torch.load_file(str(tmp_path / "model.safetensors")))
    weights["d2t"] = weights["d2t"][:-1]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        make_llm(path, speculative_config=config)
    del weights["d2t"], weights["fc.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        make_llm(path, speculative_config=config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_on_the_gpu(kind, target, tmp_path) -> None:
    """On CUDA (Triton kernels, the target's verify steps as whole-step graphs writing the feature buffer),
    fp32: the plain engine's greedy tokens, and drafts proposed every step."""
    write_head(tmp_path, kind)
    path, _ = target
    prompts = random_prompts([5, 30, 17, 2, 21], seed=2)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    # A dropped engine's memory comes back only at the next full garbage collection: a share each.
    plain = make_llm(path, block_size=16, gpu_memory_utilization=0.2)
    want = [o.outputs[0].token_ids for o in plain.generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]  # fmt: skip
    # A fixed batch limit: on a model this small the cost model finds drafting too dear to speculate.
    config = {**spec_config(kind, tmp_path), "disable_by_batch_size": 64}
    spec = make_llm(path, block_size=16, gpu_memory_utilization=0.2, speculative_config=config)
    graphs = spec.engine.runner.verify_graphs
    replays = []
    graphs.run = lambda *args, replay=graphs.run: replays.append(1) or replay(*args)
    got = spec.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert replays and spec.engine.scheduler.spec.num_drafts > 0


def test_method_is_inferred_from_the_heads_architectures(target, tmp_path) -> None:
    """vLLM's {"model": DIR, "num_speculative_tokens": k} without a method: an EAGLE-3 head (its
    config's architectures say so) drafts as one, and greedy tokens are the plain engine's."""
    write_head(tmp_path, "eagle3")
    path, _ = target
    prompts = random_prompts([12, 7], seed=3)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    spec = make_llm(
        path, max_model_len=64, speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2}
    )
    assert type(spec.engine.runner.drafter.head).__name__ == "Eagle3Head"
    assert run(spec, prompts, [params] * 2) == run(make_llm(path, max_model_len=64), prompts, [params] * 2)
    assert spec.engine.scheduler.spec.num_drafts > 0
