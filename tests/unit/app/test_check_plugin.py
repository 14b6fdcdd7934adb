"""``areal-async check-plugin``: five broken reward plug-ins give five different one-line verdicts,
broken workflows theirs; good plug-ins pass. Runs the real CLI in this process (the ``cli`` fixture,
tests/unit/conftest.py); its checks run in killable processes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from areal_async.app.commands.check_plugin import check_plugin

ROOT = Path(__file__).resolve().parents[3]
TESTS = ROOT / "tests" / "support"  # plugin_fixtures, workflow_fixtures


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    """The verdicts name the plug-ins as ``plugin_fixtures:...``: their folder on the path."""
    monkeypatch.syspath_prepend(str(TESTS))


BROKEN_REWARDS = {  # plug-in -> the start of its verdict
    "plugin_fixtures:no_such_fn": "cannot load: plug-in 'plugin_fixtures:no_such_fn': <module 'plugin_fixtures'",
    "plugin_fixtures:wrong_signature": "wrong signature: reward fn 'plugin_fixtures:wrong_signature' is "
    "wrong_signature(completion) (too many positional arguments)",
    "plugin_fixtures:returns_text": "wrong return type: reward fn 'plugin_fixtures:returns_text' returned 'correct' "
    "(str) on '7 + 5 = \\\\boxed{12}'",
    "plugin_fixtures:raises": "raises: reward fn 'plugin_fixtures:raises' raised IndexError: list index out of range",
    "plugin_fixtures:too_slow": "too slow: reward fn 'plugin_fixtures:too_slow' did not return within 1 s",
}


def test_five_broken_reward_plugins_five_messages(cli):
    seen = []
    for path, start in BROKEN_REWARDS.items():
        t = time.monotonic()
        out = cli("check-plugin", path, "--timeout-s", "1")
        assert out.returncode == 1, (path, out.stdout, out.stderr)
        line = out.stderr.strip()
        assert line.startswith("areal-async check-plugin: " + start), (path, line)
        assert "\n" not in line, line  # one message, no traceback
        seen.append(line.split(":")[1].strip())
        if path.endswith("too_slow"):
            # the check sleeps 3600 s; the rest is the pool child's interpreter start, slow on a busy machine
            assert time.monotonic() - t < 120, "the hung check was not killed at its timeout"
    assert len(set(seen)) == 5, seen  # five different kinds of failure


def test_good_reward_and_out_of_range_score(cli):
    ok = cli("check-plugin", "plugin_fixtures:good_reward")
    assert ok.returncode == 0 and ok.stdout.startswith("areal-async check-plugin: ok: reward fn"), ok.stderr
    assert "-> 1, '7 + 5 = \\\\boxed{13}' -> 0" in ok.stdout
    v = check_plugin("plugin_fixtures:out_of_range")
    assert not v.ok and v.message.startswith("score out of range") and "10.0" in v.message
    shipped = check_plugin("areal_async.reward.math_verify_reward:boxed_math_reward")
    assert shipped.ok, shipped.message


@pytest.mark.parametrize(
    "name, start",
    [
        ("ReturnsTokens", "wrong return type: workflow 'workflow_fixtures:ReturnsTokens' returned list"),
        ("SyncEpisode", "wrong signature: workflow 'workflow_fixtures:SyncEpisode' has arun_episode a plain function"),
        (
            "MaskTooShort",
            "bad episode: workflow 'workflow_fixtures:MaskTooShort' returned an Episode whose loss_mask has ",
        ),
        ("HangsInGenerate", "too slow: workflow 'workflow_fixtures:HangsInGenerate' did not finish an episode in 1 s"),
    ],
)
def test_broken_workflows(name, start):
    v = check_plugin(f"workflow_fixtures:{name}", timeout_s=1.0)
    assert v.kind == "workflow" and not v.ok and v.message.startswith(start), v.message


def test_good_workflows_pass():
    v = check_plugin("workflow_fixtures:GoodWorkflow")
    assert v.ok and "2 turn(s)" in v.message, v.message
    for shipped in (
        "areal_async.workflows.base:SingleTurn",
        "areal_async.workflows.multi_turn_math:MultiTurnMath",
        "areal_async.workflows.calculator:CalculatorTool",
    ):
        v = check_plugin(shipped)
        assert v.ok and "turn(s)" in v.message, v.message


def test_unknown_kind_refused():
    with pytest.raises(ValueError, match="kind='tool'"):
        check_plugin("plugin_fixtures:good_reward", kind="tool")
