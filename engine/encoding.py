"""How a reusable part without a declared shared prefix is encoded (CacheBlend).

Computed standalone (the default), a part's first token sits at position 0 and becomes an
attention sink: a blend of several such parts carries several false sinks. With the
"preamble" encoding a part's KV is computed after a fixed preamble (what the model always
sees before a prompt's text), the preamble's KV is dropped and only the part's own KV is
stored, its header's base position the preamble's length (the blend re-rotates it like any
segment). On SmolLM2 the preamble encoding deviated more than standalone with 4 parts, so it
is an option (docs/cacheblend.md). Its key names the preamble (keys.py: the after-prefix key
of the preamble), so parts encoded standalone and after a preamble never share a key.
"""

from __future__ import annotations

from tierkv.engine.tokenizer import Tokenizer

# A model without a tokenizer (the random-weight benchmark models): one fixed token stands in
# for the BOS every prompt would start with.
FIXED_RUN = (0,)
_MARK = "\x1fpart\x1f"  # a user message's text, found in the template's rendering


def preamble(tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """The tokens a part is encoded after: for a chat checkpoint, the chat template's rendering
    before the first user message's text (its system preamble and the user turn's header, where
    a document sits in a chat prompt), led by the BOS token unless the template writes it; for
    a tokenizer without a template (or one that cannot render a lone user message), its BOS
    (or FIXED_RUN without one); without a tokenizer, FIXED_RUN."""
    if tokenizer is None:
        return FIXED_RUN
    bos = tokenizer.token_id(tokenizer.bos_token) if tokenizer.bos_token else None
    ids: list[int] = []
    if tokenizer.chat_template is not None:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], False)
            ids = tokenizer.encode(text[: text.index(_MARK)], add_special_tokens=False)
        except Exception:  # a template that refuses a lone user message: BOS alone
            ids = []
    if bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    return tuple(ids) or FIXED_RUN
