"""Prefill/decode disaggregation in the API process.

Decode instance (`--kv-role decode --kv-peer HOST:PORT[,...]`): a request whose prompt has at least
`--remote-prefill-min-tokens` tokens is first sent to the least loaded prefill peer as an ordinary
completion of one token with `kv_transfer_params: {"do_remote_decode": true}`; the peer computes the
prompt, samples that token and keeps the prompt's KV blocks, and answers with where to fetch them. The
request then enters this instance's engine with that first token and the peer's address: the engine
core fetches the KV into its own blocks and decodes from there, computing no prompt token itself.
Requests the peer cannot take over as they are (n > 1, logprobs, structured outputs, a single token)
and shorter prompts are prefilled here.

Prefill instance (`--kv-role prefill`): such a request runs with its blocks held when it finishes, and
the answer carries `kv_transfer_params` (`kv_address`, `transfer_id`, `first_token_id`)."""

from __future__ import annotations

import socket

import aiohttp

from tokenmill.core.kv_transfer import RemotePrefill
from tokenmill.sampling_params import SamplingParams

from .errors import OpenAIError


def kv_address(host: str, port: int) -> str:
    """The address decode peers reach this prefill instance's KV on."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    return f"tcp://{host}:{port}"


def remote_decode_wanted(params: dict | None) -> bool:
    return bool(params and params.get("do_remote_decode"))


class PrefillPeers:
    def __init__(self, peers: list[str], min_tokens: int, timeout_s: float) -> None:
        if min_tokens < 1:
            raise ValueError(f"--remote-prefill-min-tokens must be >= 1, got {min_tokens}")
        self.urls = [p if p.startswith(("http://", "https://")) else f"http://{p}" for p in peers]
        if not self.urls:
            raise ValueError("--kv-role decode needs at least one --kv-peer HOST:PORT (a prefill instance)")
        self.min_tokens = min_tokens
        self.timeout_s = timeout_s
        self.in_flight = dict.fromkeys(self.urls, 0)
        self._models: dict[str, str] = {}
        self._session: aiohttp.ClientSession | None = None

    def eligible(self, token_ids: list[int], params: SamplingParams, n: int) -> bool:
        return (
            len(token_ids) >= self.min_tokens
            and n == 1
            and params.logprobs is None
            and params.prompt_logprobs is None
            and params.structured_outputs is None
            and (params.max_tokens or 0) > 1
        )

    async def prefill(
        self, token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> RemotePrefill:
        """The prompt computed by a peer: its first token and where its KV waits. A peer that fails is a
        503 for this request only."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        url = min(self.urls, key=lambda u: self.in_flight[u])
        self.in_flight[url] += 1
        try:
            body = {
                "model": await self._model(url),
                "prompt": token_ids,
                "max_tokens": 1,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "min_p": params.min_p,
                "seed": params.seed,
                "repetition_penalty": params.repetition_penalty,
                "min_tokens": min(params.min_tokens, 1),
                "ignore_eos": params.ignore_eos,
                "logit_bias": params.logit_bias,
                "kv_transfer_params": {"do_remote_decode": True},
                "cache_salt": cache_salt,  # the peer's prefix cache keeps the tenants apart too
            }
            async with self._session.post(f"{url}/v1/completions", json=body) as response:
                answer = await response.json(content_type=None)
                if response.status != 200:
                    message = (answer.get("error") or {}).get("message", answer)
                    raise _failed(url, f"answered {response.status}: {message}")
            kv = answer["kv_transfer_params"]
            return RemotePrefill(int(kv["first_token_id"]), kv["kv_address"], kv["transfer_id"])
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            raise _failed(url, f"{type(exc).__name__}: {exc}") from exc
        finally:
            self.in_flight[url] -= 1

    async def _model(self, url: str) -> str:
        model = self._models.get(url)
        if model is None:
            assert self._session is not None
            async with self._session.get(f"{url}/v1/models") as response:
                model = (await response.json())["data"][0]["id"]
            self._models[url] = model
        return model

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _failed(url: str, reason: str) -> OpenAIError:
    return OpenAIError(
        503, f"the prefill peer {url} failed: {reason}", "service_unavailable", code="prefill_failed"
    )
