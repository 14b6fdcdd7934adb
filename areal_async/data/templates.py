"""Prompt templates: how a dataset prompt becomes the token ids a rollout engine receives.

One function, ``render_prompt_ids``, is used by RL (the scheduler tokenizes every prompt it
issues with it), SFT and the SFT warm-up (the prompt part of each example) and evaluation, so a
model is trained and evaluated on the same text.

    none  [bos] + prompt                                   the plain text, as in tiny_arith
    chat  the tokenizer's chat template: one user turn, generation prompt added
    r1    chat template of  prompt + "\\n" + R1_INSTRUCTION,  then "<think>\\n" (the seed's protocol:
          DeepSeek-R1-Distill models are told to box their answer and forced to start thinking)

``chat`` and ``r1`` need a tokenizer with a chat template (the embedded character tokenizer has
a small one: ``User: ...\\nAssistant: ``); one without it is refused with an error naming the
template. A chat template that already ends its generation prompt with ``<think>\\n`` (newer
R1-Distill tokenizers do) does not get a second one.
"""

from __future__ import annotations

from areal_async.config.sections import TEMPLATES

__all__ = ["TEMPLATES", "R1_INSTRUCTION", "THINK_PREFIX", "render_prompt_text", "render_prompt_ids"]
R1_INSTRUCTION = "Please reason step by step, and enclose your final answer in \\boxed{}."
THINK_PREFIX = "<think>\n"


def render_prompt_text(tokenizer, prompt: str, template: str) -> str:
    """The prompt as text after the template (special tokens of the chat template included as text)."""
    if template == "none":
        return prompt
    if template not in TEMPLATES:
        raise ValueError(f"template {template!r}: expected one of {' | '.join(TEMPLATES)}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"template {template!r} needs a tokenizer with a chat template; "
            f"{type(tokenizer).__name__} {getattr(tokenizer, 'name_or_path', '')!r} has none "
            "(use train_dataset.template=none)"
        )
    content = prompt if template == "chat" else f"{prompt}\n{R1_INSTRUCTION}"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    if template == "r1" and not text.endswith(THINK_PREFIX):
        text += THINK_PREFIX
    return text


def render_prompt_ids(tokenizer, prompt: str, template: str) -> list[int]:
    """Token ids of the templated prompt. ``none`` adds [bos] (when the tokenizer has one); the chat
    templates write their own special tokens, so nothing is added to them."""
    text = render_prompt_text(tokenizer, prompt, template)
    if template != "none":
        return tokenizer.encode(text, add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(text, add_special_tokens=False)
