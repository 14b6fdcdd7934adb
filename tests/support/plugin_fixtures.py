"""Plug-ins broken on purpose (and two good ones), for ``areal-async check-plugin``
(tests/unit/app/test_check_plugin.py).

Named as ``"plugin_fixtures:<name>"``: pytest puts ``tests/`` on ``sys.path`` and the checker
hands its ``sys.path`` to the processes it runs them in.
"""

import time

NOT_A_FUNCTION = 0.5


def good_reward(completion, solutions, **kwargs):
    return 1.0 if any(f"\\boxed{{{s}}}" in completion for s in solutions) else 0.0


def wrong_signature(completion):
    return 1.0


def returns_text(completion, solutions):
    return "correct"


def raises(completion, solutions):
    return 1.0 / len(completion.split("=")[5])


def too_slow(completion, solutions):
    time.sleep(3600)
    return 1.0


def out_of_range(completion, solutions):
    return 10.0
