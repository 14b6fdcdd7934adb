"""A calculator tool the model may call, GSM8K style: it writes ``<<EXPR=`` and the tool appends ``RESULT>>``.

Each model turn stops at ``=`` (when the tokenizer has a single token for it); a turn whose
text ends in ``<<EXPR=`` with ``EXPR`` made of digits, ``+ - *`` and parentheses is a call: the
tool's answer ``RESULT>>`` is appended as tool tokens (loss mask 0: not trained) and the model
continues, up to ``max_calls`` calls. A turn that is not a call ends the episode, scored with
``reward.fn`` on everything after the prompt (so a ``\\boxed{}`` after a call counts). An
expression the tool cannot evaluate gets ``?>>``. Knobs are class attributes.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re

from areal_async.workflows.base import EngineHandle, Episode, EpisodeBuilder, Prompt, RolloutWorkflow

CALL = re.compile(r"<<([0-9+\-*() ]{1,40})=$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculate(expr: str) -> str:
    """The value of an integer expression of + - * and parentheses, or '?' (never eval)."""
    try:
        value = _eval(ast.parse(expr, mode="eval").body)
    except (SyntaxError, ValueError, KeyError, RecursionError):
        return "?"
    return str(value) if abs(value) < 10**12 else "?"


def _eval(node) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp):
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp):
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"not an integer expression: {ast.dump(node)[:60]}")


class CalculatorTool(RolloutWorkflow):
    max_calls: int = 2

    async def arun_episode(self, engine: EngineHandle, prompt: Prompt) -> Episode:
        tok = engine.tokenizer
        b = EpisodeBuilder(prompt.prompt_ids)
        eq = tok.encode("=", add_special_tokens=False)
        sampling = prompt.sampling
        if len(eq) == 1:
            sampling = dataclasses.replace(sampling, stop_token_ids=tuple(sampling.stop_token_ids) + tuple(eq))
        for calls in range(self.max_calls + 1):
            gen = await engine.generate(b.input_ids, sampling)
            b.add_generation(gen)
            call = CALL.search(tok.decode(gen.output_ids, skip_special_tokens=True))
            if call is None or calls == self.max_calls:
                break
            b.add_env(tok.encode(calculate(call.group(1)) + ">>", add_special_tokens=False))
        text = tok.decode(b.episode.output_ids, skip_special_tokens=True)
        return b.finish(await engine.reward(text, prompt.solutions))
