"""OpenAI request bodies -> engine prompts and SamplingParams, checked field by field (a bad
field is a 400 naming it, as the OpenAI API answers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierkv.engine.blend import PromptPart
from tierkv.engine.blend_rules import parse_rule
from tierkv.engine.llm import LLM, Prompt
from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.serve.config import ServeConfig
from tierkv.engine.serve.fields import APIError, check, typed
from tierkv.engine.tokenizer import Message
from tierkv.storage_backends.hints import HintError, KVHint, parse_hint


@dataclass(slots=True)
class ParsedRequest:
    chat: bool
    prompts: list[Prompt]  # one job each; completions may send a batch of prompts
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    kv_hint: KVHint | None = None  # 'kv_hints' (tierkv's extension): the workflow step


def parse(body: Any, chat: bool, llm: LLM, cfg: ServeConfig) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = typed(body, "model", str, cfg.model_name)
    if model != cfg.model_name:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves '{cfg.model_name}'",
            "model",
            "model_not_found",
        )
    temperature = float(typed(body, "temperature", (int, float), 1.0))
    check(0.0 <= temperature <= 2.0, "'temperature' must be in [0, 2]", "temperature")
    top_p = float(typed(body, "top_p", (int, float), 1.0))
    check(0.0 < top_p <= 1.0, "'top_p' must be in (0, 1]", "top_p")
    top_k = typed(body, "top_k", int, 0)  # vLLM's extension
    check(top_k >= 0 or top_k == -1, "'top_k' must be >= 0 (or -1: off)", "top_k")
    n = typed(body, "n", int, 1)
    check(1 <= n <= cfg.max_n, f"'n' must be in [1, {cfg.max_n}]", "n")
    seed = typed(body, "seed", int, None)
    default = cfg.default_chat_max_tokens if chat else cfg.default_max_tokens
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = typed(body, name, int, default)
    check(max_tokens >= 1, f"'{name}' must be >= 1", name)
    for pen in ("presence_penalty", "frequency_penalty"):
        check(typed(body, pen, (int, float), 0) == 0, f"'{pen}' is not supported (only 0)", pen)
    check(typed(body, "best_of", int, n) == n, "'best_of' is not supported", "best_of")
    check(not typed(body, "echo", bool, False), "'echo' is not supported", "echo")
    stop = typed(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    check(
        len(stop) <= 4 and all(isinstance(s, str) and s for s in stop),
        "'stop' must be a non-empty string or an array of at most 4 of them",
        "stop",
    )
    stream = typed(body, "stream", bool, False)
    opts = typed(body, "stream_options", dict, {})
    include_usage = bool(opts.get("include_usage", False))
    if chat:
        want = typed(body, "logprobs", bool, False)
        top = typed(body, "top_logprobs", int, 0)
        check(
            0 <= top <= cfg.max_logprobs,
            f"'top_logprobs' must be in [0, {cfg.max_logprobs}]",
            "top_logprobs",
        )
        check(want or not top, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = top if want else None
    else:
        logprobs = typed(body, "logprobs", int, None)
        check(
            logprobs is None or 0 <= logprobs <= cfg.max_logprobs,
            f"'logprobs' must be in [0, {cfg.max_logprobs}]",
            "logprobs",
        )
    salt = typed(body, "cache_salt", str, None)
    check(
        salt is None or 0 < len(salt) <= 256,
        "'cache_salt' must hold 1-256 characters",
        "cache_salt",
    )
    ratio, rule = blend_knobs(body)
    params = SamplingParams(
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
        n=n,
        ignore_eos=typed(body, "ignore_eos", bool, False),
        logprobs=logprobs,
        cache_salt=salt,
        blend_ratio=ratio,
        blend_rule=rule,
    )
    hint = kv_hint(body)
    prompts = [chat_prompt(body, llm)] if chat else completion_prompts(body, llm)
    return ParsedRequest(
        chat, prompts, params, stream, include_usage, stop, logprobs is not None, hint
    )


def blend_knobs(body: dict[str, Any]) -> tuple[float | None, str | None]:
    """'blend_ratio' and 'blend_rule' (tierkv's extensions): how a request with 'documents'
    blends them (None: the engine's); a bad one is a 400 naming it."""
    ratio = typed(body, "blend_ratio", (int, float), None)
    check(ratio is None or 0.0 <= ratio <= 1.0, "'blend_ratio' must be in [0, 1]", "blend_ratio")
    rule = typed(body, "blend_rule", str, None)
    if rule is not None:
        try:
            parse_rule(rule, "blend_rule")
        except ValueError as e:
            raise APIError(400, f"'blend_rule' is malformed: {e}", "blend_rule") from None
    return None if ratio is None else float(ratio), rule


def kv_hint(body: dict[str, Any]) -> KVHint | None:
    """'kv_hints': a workflow hint (storage_backends.hints); a malformed one is a 400 naming
    its field, e.g. 'kv_hints.next_use.coder'."""
    if body.get("kv_hints") is None:
        return None
    try:
        return parse_hint(body["kv_hints"], "kv_hints")
    except HintError as e:
        raise APIError(400, f"'kv_hints' is malformed: {e}", e.field) from None


def completion_prompts(body: dict[str, Any], llm: LLM) -> list[Prompt]:
    """'prompt': a string, an array of strings, an array of token ids, or an array of those."""
    p = body.get("prompt")
    bad = APIError(
        400,
        "'prompt' must be a string, an array of strings, an array of token "
        "ids or an array of token-id arrays, none empty",
        "prompt",
    )
    if isinstance(p, str):
        p = [p]
    elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        p = [p]
    if not isinstance(p, list) or not p:
        raise bad
    out: list[list[int]] = []
    for one in p:
        if isinstance(one, str) and one:
            if llm.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
            out.append(llm.tokenizer.encode(one))
        elif isinstance(one, list) and one and all(_is_token(t) for t in one):
            out.append(list(one))
        else:
            raise bad
    vocab = llm.model_config.vocab_size
    if any(not 0 <= t < vocab for ids in out for t in ids):
        raise APIError(400, f"token ids must be in [0, {vocab})", "prompt")
    return list(out)


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def messages_of(body: dict[str, Any]) -> list[Message]:
    """'messages' with each content a string or an array of text parts (joined)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty array", "messages")
    out: list[Message] = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise APIError(
                400,
                "each message needs a 'role' of system, developer, user, assistant or tool",
                "messages",
            )
        content = m.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                for c in content
            ):
                raise APIError(400, "only text content parts are supported", "messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise APIError(400, "each message needs a string 'content'", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def chat_prompt(body: dict[str, Any], llm: LLM) -> Prompt:
    """The chat template's rendering of the messages. With 'documents' (tierkv's extension):
    the rendered system message as the shared prefix, each document a reusable segment
    (CacheBlend reuses its KV at any position), then the rest of the conversation."""
    tok = llm.tokenizer
    if tok is None or tok.chat_template is None:
        raise APIError(400, "this model has no chat template: use /v1/completions")
    msgs = messages_of(body)
    docs = typed(body, "documents", list, [])
    if not all(isinstance(d, str) and d for d in docs):
        raise APIError(400, "'documents' must be an array of non-empty strings", "documents")
    try:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    if not docs:
        return tok.encode(text, add_special_tokens=False)
    parts: list[PromptPart] = []
    if msgs[0]["role"] == "system":
        head = tok.apply_chat_template(msgs[:1], add_generation_prompt=False)
        if text.startswith(head):
            parts.append(PromptPart(tok.encode(head, add_special_tokens=False), prefix=True))
            text = text[len(head) :]
    parts += [PromptPart(tok.encode(d, add_special_tokens=False)) for d in docs]
    parts.append(PromptPart(tok.encode(text, add_special_tokens=False), reusable=False))
    if any(not p.content for p in parts):
        raise APIError(400, "a document or message renders to no tokens", "documents")
    return parts
