"""The calculator tool of ``calculator.py`` as an agent written only against ``openai.AsyncOpenAI``.

``rollout.agent: areal_async.workflows.calculator_agent:calculator_agent`` (``configs/agent_calculator.yaml``).
The same episode as ``CalculatorTool``, but through the rollout worker's OpenAI-compatible endpoint: the
agent sends the templated prompt as text to ``/v1/completions`` with ``stop=["="]``; a completion that ends
in ``<<EXPR`` (stopped at ``=``) is a call, and the agent appends ``=RESULT>>`` and asks again, up to
``MAX_CALLS`` calls; the episode is scored with the run's ``reward.fn`` on everything the model wrote.
Each request is one turn; the endpoint reads back the sampled tokens (the next prompt's text continues the
previous prompt + completion), so the tool's ``RESULT>>`` is the only context the trajectory adds.
"""

from __future__ import annotations

import re

from areal_async.workflows.calculator import calculate

MAX_CALLS = 2
CALL = re.compile(r"<<([0-9+\-*() ]{1,40})$")


async def calculator_agent(client, task, max_tokens: int = 12):
    text, calls = "", 0
    while True:
        r = await client.completions.create(
            model="policy", prompt=task["prompt_text"] + text, max_tokens=max_tokens, stop=["="]
        )
        choice = r.choices[0]
        text += choice.text
        call = CALL.search(choice.text) if choice.finish_reason == "stop" else None
        if call is None or calls == MAX_CALLS:
            break
        calls += 1
        text += "=" + calculate(call.group(1)) + ">>"  # the stop string, then the tool's answer
    return await task["score"](text, task["solutions"]), {"calls": calls, "text": text}


FEEDBACK = " Wrong, try again: "


async def calculator_retry_agent(client, task, max_tries: int = 2, discount: float = 0.5):
    """``calculator_agent`` with another try after a wrong answer (as ``multi_turn_math``): the prompt, the
    attempt and ``FEEDBACK`` then the question again; try k (0-based) that is right scores ``discount ** k``.
    A completions client never sees the end-of-sequence token that ended an attempt, so the retry prompt's
    text does not continue the previous turn's ids: template drift, trained as two segments under
    ``rollout.agent_drift: segments`` (and refused under ``refuse``)."""
    prompt, history = task["prompt_text"], ""
    for k in range(max_tries):
        task_k = dict(task, prompt_text=prompt + history)
        score, info = await calculator_agent(client, task_k)
        if score > 0:
            return discount**k, {"tries": k + 1, **info}
        history += info["text"] + FEEDBACK + task["prompt"]
    return 0.0, {"tries": max_tries, **info}
