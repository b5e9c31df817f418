"""A chat request with cartridges is answered by vLLM's /v1/completions and rebuilt in chat's
shape (`api.gateway.completion_to_chat`, `completion_chunk_to_chat`). Judged here by vLLM's own
response models (what its /v1/chat/completions serializes) and the OpenAI SDK's: the rebuilt
answer has every field vLLM's chat answer has, chat's logprobs, and vLLM's extra fields carried
through. The same against a real vLLM server, call by call through the SDK:
tests/test_gateway_e2e.py."""

from __future__ import annotations

import pytest

from lmcache_cartridge.api.gateway import chat_logprobs, completion_chunk_to_chat, completion_to_chat

pytestmark = pytest.mark.heavy  # imports vLLM's protocol modules


def keys(obj, path=""):
    if isinstance(obj, dict):
        return {path} | {p for k, v in obj.items() for p in keys(v, f"{path}.{k}")}
    if isinstance(obj, list):
        return {path} | {p for v in obj for p in keys(v, path + "[]")}
    return {path}


def _completion_logprobs(tokens, lps, tops):
    from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs

    return CompletionLogProbs(tokens=tokens, token_logprobs=lps, top_logprobs=tops,
                              text_offset=list(range(len(tokens))))


def vllm_completion(n: int = 2) -> dict:
    """A completion answer as vLLM's own models serialize it (logprobs=2: each step's sampled
    token first, then the top 2, as vLLM orders them; vLLM's extra fields set)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    lp = _completion_logprobs([" a", "é"], [-0.1, -2.5],
                              [{" a": -0.1, " b": -3.0}, {"é": -2.5, "x": -0.5, "y": -1.0}])
    choices = [CompletionResponseChoice(index=i, text=" aé", logprobs=lp, finish_reason="stop", stop_reason=".",
                                        token_ids=[5, 6], prompt_token_ids=[1, 2, 3]) for i in range(n)]
    return CompletionResponse(id="cmpl-x1", model="m", choices=choices, system_fingerprint="fp-1",
                              usage=UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5),
                              kv_transfer_params={"k": 1}).model_dump(mode="json")


def vllm_chat(n: int = 2) -> dict:
    """vLLM's chat answer for the same generation (the oracle's field set)."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionResponse,
        ChatCompletionResponseChoice, ChatMessage)
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    def lp(token, logprob, tops):
        return ChatCompletionLogProbsContent(token=token, logprob=logprob, bytes=list(token.encode()),
                                             top_logprobs=[ChatCompletionLogProb(token=t, logprob=v,
                                                                                 bytes=list(t.encode()))
                                                           for t, v in tops])
    logprobs = ChatCompletionLogProbs(content=[lp(" a", -0.1, [(" a", -0.1), (" b", -3.0)]),
                                               lp("é", -2.5, [("é", -2.5), ("x", -0.5)])])
    choices = [ChatCompletionResponseChoice(index=i, message=ChatMessage(role="assistant", content=" aé"),
                                            logprobs=logprobs, finish_reason="stop", stop_reason=".",
                                            token_ids=[5, 6]) for i in range(n)]
    return ChatCompletionResponse(id="chatcmpl-x1", model="m", choices=choices, system_fingerprint="fp-1",
                                  usage=UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5),
                                  prompt_token_ids=[1, 2, 3], kv_transfer_params={"k": 1}).model_dump(mode="json")


def test_a_rebuilt_chat_answer_is_vllms_chat_answer():
    from openai.types.chat import ChatCompletion
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    got = completion_to_chat(vllm_completion(), top_logprobs=2)
    assert got == vllm_chat()  # every field and value, chat's logprobs included
    ChatCompletionResponse.model_validate(got)
    sdk = ChatCompletion.model_validate(got)
    assert sdk.choices[1].logprobs.content[1].top_logprobs[1].token == "x"
    assert sdk.system_fingerprint == "fp-1" and sdk.model_extra["kv_transfer_params"] == {"k": 1}
    assert sdk.choices[0].model_extra["stop_reason"] == "." and sdk.choices[0].model_extra["token_ids"] == [5, 6]


def test_chat_logprobs_keep_vllms_order_and_count():
    """Chat gives a step's first `top_logprobs` alternatives (vLLM's order: the sampled token
    first), completions one more; 0 gives none, -1 all; a step without logprobs keeps its token."""
    lp = {"tokens": ["a", "b"], "token_logprobs": [-1.0, None], "top_logprobs": [{"a": -1.0, "z": -0.5}, None]}
    assert [t["top_logprobs"] for t in chat_logprobs(lp, 1)["content"]] == [[{"token": "a", "logprob": -1.0,
                                                                            "bytes": [97]}], []]
    assert [len(t["top_logprobs"]) for t in chat_logprobs(lp, 0)["content"]] == [0, 0]
    assert [len(t["top_logprobs"]) for t in chat_logprobs(lp, -1)["content"]] == [2, 0]
    assert chat_logprobs(lp, 1)["content"][1]["logprob"] == -9999.0  # vLLM's value for a missing one
    assert chat_logprobs(None, 2) is None


def test_rebuilt_stream_chunks_carry_roles_logprobs_and_the_usage_chunk():
    """Each choice's first delta names the assistant (with n > 1 too), logprobs come in chat's
    shape, and the usage chunk of `stream_options.include_usage` (no choices) keeps its usage."""
    from openai.types.chat import ChatCompletionChunk
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    def chunk(i, text, finish=None):
        lp = _completion_logprobs([text], [-0.2], [{text: -0.2, "q": -1.9, "r": -2.0}])
        c = CompletionResponseStreamChoice(index=i, text=text, logprobs=lp, finish_reason=finish,
                                           stop_reason=None)
        return CompletionStreamResponse(id="cmpl-s", model="m", choices=[c]).model_dump(mode="json",
                                                                                      exclude_unset=True)
    usage = CompletionStreamResponse(id="cmpl-s", model="m", choices=[], system_fingerprint="fp",
                                     usage=UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
                                     ).model_dump(mode="json", exclude_none=True)
    seen: set[int] = set()
    out = [completion_chunk_to_chat(c, seen, 2) for c in
           (chunk(0, "A"), chunk(1, "B"), chunk(0, "C", "length"), chunk(1, "D", "length"), usage)]
    for o in out:
        ChatCompletionStreamResponse.model_validate(o)
        ChatCompletionChunk.model_validate(o)
    assert [(c["index"], c["delta"].get("role")) for o in out[:4] for c in o["choices"]] == \
        [(0, "assistant"), (1, "assistant"), (0, None), (1, None)]
    assert out[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1]["token"] == "q"
    assert len(out[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert out[-1]["choices"] == [] and out[-1]["usage"]["completion_tokens"] == 2
    assert out[-1]["system_fingerprint"] == "fp" and out[-1]["object"] == "chat.completion.chunk"
