"""The OpenAI chat/completions schema on this side: requests read, prompts rendered, answers written.

What ``openai_server`` needs and nothing of HTTP: ``chat_request`` / ``completion_request`` check a
request body (the fields of the ``openai`` package's ``CompletionCreateParams`` this server honours,
and a clear 400 for the ones it cannot), ``render_chat`` turns messages (and tools) into token ids
through the model's own chat template, ``parse_tool_calls`` reads the Hermes / Qwen2.5 form
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) out of a completion, and ``chat_answer``
/ ``completion_answer`` write the ``ChatCompletion`` / ``Completion`` objects the ``openai`` client
parses (``openai/types/chat/chat_completion.py``, ``openai/types/completion.py``), with the exact
token ids as extra fields (``prompt_token_ids``, ``token_ids``: vLLM's names for the same thing).

Supported: n = 1; ``max_tokens`` / ``max_completion_tokens``; ``temperature`` (0: greedy), ``top_p``;
``stop`` given as strings that are single tokens of the tokenizer (the engine stops on token ids);
``tools`` where the chat template renders them (else 400: the model would never see them); tool
messages and assistant ``tool_calls`` in the history; ``logprobs`` (the sampled token's). Refused
with 400: ``n`` > 1, ``stream``, multi-token stop strings, non-text content parts (images, audio),
``logit_bias``, ``response_format`` other than text, ``top_logprobs`` > 0.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from areal_async.workflows.base import Generation, Sampling


class BadRequest(ValueError):
    """A request this endpoint refuses (HTTP 400, OpenAI's error body)."""


@dataclass
class GenParams:
    """Sampling asked for by one request, and what its answer should carry."""

    sampling: Sampling
    model: str
    logprobs: bool = False
    tools: Optional[list] = None
    extra: dict = field(default_factory=dict)


_REFUSED = {
    "stream": "streaming is not served by this endpoint (set stream=false)",
    "logit_bias": "logit_bias is not supported (the engine samples from the policy's own distribution)",
}
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise BadRequest(f"{name}={value!r}: expected a number in [{lo}, {hi}]")
    return float(value)


def _int(body: dict, names: tuple[str, ...], default: int, hi: int) -> int:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
            raise BadRequest(f"{name}={value!r}: expected an integer in [1, {hi}]")
        return value
    return default


def _stop_ids(tokenizer, stop) -> tuple[int, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    ids = []
    for s in stops:
        enc = tokenizer.encode(s, add_special_tokens=False) if isinstance(s, str) else []
        if len(enc) != 1:
            raise BadRequest(
                f"stop={s!r} is {len(enc)} tokens of this tokenizer; the engine stops on token ids, so each stop "
                "string must be a single token"
            )
        ids.append(enc[0])
    return tuple(ids)


def gen_params(body: dict, tokenizer, default_max_tokens: int, max_tokens_limit: int) -> GenParams:
    """The sampling of a chat or completion request body (``BadRequest`` for what is refused)."""
    if not isinstance(body, dict):
        raise BadRequest(f"body {body!r:.80}: expected a JSON object")
    for name, why in _REFUSED.items():
        if body.get(name):
            raise BadRequest(why)
    if body.get("n") not in (None, 1):
        raise BadRequest(f"n={body.get('n')!r}: this endpoint answers one choice per request (n=1)")
    if body.get("top_logprobs"):
        raise BadRequest("top_logprobs is not supported (logprobs=true gives the sampled token's)")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise BadRequest(f"response_format={fmt!r}: only text is supported")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    sampling = Sampling(
        max_new_tokens=_int(body, ("max_completion_tokens", "max_tokens"), default_max_tokens, max_tokens_limit),
        temperature=temperature if temperature > 0 else 1.0,
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        greedy=temperature == 0,
        stop_token_ids=_stop_ids(tokenizer, body.get("stop")),
    )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(f"model={model!r}: expected a model name (any name is accepted)")
    return GenParams(sampling, model, bool(body.get("logprobs")), body.get("tools") or None)


# ---- chat: messages -> prompt ids -------------------------------------------------------------------
def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise BadRequest(f"{where}: content part {p!r:.80} is not text (only text parts are supported)")
            parts.append(p["text"])
        return "".join(parts)
    raise BadRequest(f"{where}: content {content!r:.80}: expected a string or a list of text parts")


def _tool_call_for_template(call: dict, where: str) -> dict:
    """An OpenAI tool call as chat templates take it: ``arguments`` as a dict (the JSON string decoded)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest(f"{where}: tool call {call!r:.80}: expected {{'type': 'function', 'function': {{name, ...}}}}")
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass  # the template renders the string as given
    return {"type": "function", "id": call.get("id"), "function": {"name": fn["name"], "arguments": args}}


def template_messages(messages) -> list[dict]:
    """OpenAI chat messages as ``apply_chat_template`` takes them (text content, tool calls decoded)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"messages={messages!r:.80}: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"{where}={m!r:.80}: expected a message with a role system|user|assistant|tool")
        msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": _text(m.get("content"), where)}
        if m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call_for_template(c, where) for c in m["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def render_chat(tokenizer, messages, tools: Optional[list] = None) -> tuple[list[int], str]:
    """(prompt ids, prompt text) of ``messages`` under the tokenizer's chat template, generation prompt
    added; ``BadRequest`` when the tokenizer has no template, or ``tools`` are given and the template
    does not render them."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model's tokenizer has no chat template: use /v1/completions with a text prompt")
    msgs = template_messages(messages)
    try:
        text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
        if tools and text == tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True):
            raise BadRequest(
                "tools were given but this model's chat template does not render them (the model would never "
                "see them): describe the tools in a message and parse the model's text, or use a model whose "
                "template supports tools"
            )
    except BadRequest:
        raise
    except Exception as e:  # jinja's own errors (a template that raises on this conversation)
        raise BadRequest(f"the chat template refused these messages: {type(e).__name__}: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False), text


def parse_tool_calls(text: str, call_prefix: str) -> tuple[Optional[str], list[dict]]:
    """(content without the tool-call blocks, or None when empty; OpenAI tool calls) of a completion in the
    Hermes / Qwen2.5 form. A block that is not ``{"name": str, "arguments": object}`` JSON stays text."""
    calls, kept, at = [], [], 0
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            continue
        args = obj.get("arguments", {})
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(
            {
                "id": f"{call_prefix}-{len(calls)}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    content = ("".join(kept) + text[at:]).strip() if calls else text
    return (content or None), calls


# ---- answers ------------------------------------------------------------------------------------
FINISH = {"stop": "stop", "length": "length"}


def _usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _chat_logprobs(tokenizer, gen: Generation) -> dict:
    return {
        "content": [
            {"token": tokenizer.decode([t]), "logprob": float(lp), "bytes": None, "top_logprobs": []}
            for t, lp in zip(gen.output_ids, gen.logprobs)
        ]
    }


def stop_reason(params: GenParams, gen: Generation) -> Optional[int]:
    """The request's stop token that ended the generation, or None (eos, length): vLLM's ``stop_reason``."""
    last = gen.output_ids[-1] if gen.output_ids else None
    return last if gen.finish_reason == "stop" and last in params.sampling.stop_token_ids else None


def visible_text(tokenizer, params: GenParams, gen: Generation) -> str:
    """The answer's text: special tokens skipped and, as OpenAI (and vLLM) answer, without the stop string
    that ended it (the token is still in ``token_ids`` and in the trained episode)."""
    ids = gen.output_ids[:-1] if stop_reason(params, gen) is not None else gen.output_ids
    return tokenizer.decode(ids, skip_special_tokens=True)


def chat_answer(tokenizer, params: GenParams, prompt_ids: list[int], gen: Generation) -> dict:
    """A ``chat.completion`` object for one generation (tool calls parsed when the request gave tools)."""
    text = visible_text(tokenizer, params, gen)
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    content, calls = parse_tool_calls(text, f"call-{rid[-12:]}") if params.tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    finish = "tool_calls" if calls else FINISH[gen.finish_reason]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": params.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": _chat_logprobs(tokenizer, gen) if params.logprobs else None,
                "token_ids": list(gen.output_ids),
                "stop_reason": _stop_text(tokenizer, params, gen),
            }
        ],
        "usage": _usage(len(prompt_ids), len(gen.output_ids)),
        "prompt_token_ids": list(prompt_ids),
        "versions": sorted(set(gen.versions)),
    }


def _stop_text(tokenizer, params: GenParams, gen: Generation) -> Optional[str]:
    tid = stop_reason(params, gen)
    return None if tid is None else tokenizer.decode([tid])


def completion_prompt_ids(tokenizer, prompt) -> list[int]:
    """A completion request's prompt: a string (tokenized with the tokenizer's special tokens, as vLLM
    does) or a list of token ids (used as given); a one-element list of either is that element."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise BadRequest(f"prompt={prompt!r:.80}: expected one non-empty string or one list of token ids")


def completion_answer(tokenizer, params: GenParams, prompt_ids: list[int], gen: Generation) -> dict:
    """A ``text_completion`` object for one generation."""
    logprobs = None
    if params.logprobs:
        tokens = [tokenizer.decode([t]) for t in gen.output_ids]
        logprobs = {"tokens": tokens, "token_logprobs": [float(x) for x in gen.logprobs], "top_logprobs": None}
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": params.model,
        "choices": [
            {
                "index": 0,
                "text": visible_text(tokenizer, params, gen),
                "finish_reason": FINISH[gen.finish_reason],
                "logprobs": logprobs,
                "token_ids": list(gen.output_ids),
                "stop_reason": _stop_text(tokenizer, params, gen),
            }
        ],
        "usage": _usage(len(prompt_ids), len(gen.output_ids)),
        "prompt_token_ids": list(prompt_ids),
    }


def error_body(message: str, code: int, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object (``openai._exceptions.APIStatusError`` reads ``error.message``)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
