"""load_callable: both path forms, caching, and an error naming the path for each failure."""

import os.path

import pytest

from areal_async.base.plugins import load_callable


def test_loads_colon_and_dotted_forms():
    assert load_callable("os.path:join") is os.path.join
    assert load_callable("os.path.join") is os.path.join
    assert load_callable("tests.support.reward_fixtures:exact_match")("a", ["a"]) == 1.0


def test_nested_attribute_after_colon():
    assert load_callable("os:path.join") is os.path.join


def test_cached():
    load_callable.cache_clear()
    load_callable("os.path:join")
    load_callable("os.path:join")
    assert load_callable.cache_info().hits == 1


@pytest.mark.parametrize(
    "path, words",
    [
        ("", "non-empty"),
        (None, "non-empty"),
        ("nodots", "malformed"),
        (":join", "malformed"),
        ("os.path:", "malformed"),
        ("a:b:c", "malformed"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("os.path:no_such_fn", "no attribute 'no_such_fn'"),
        ("tests.support.reward_fixtures:NOT_CALLABLE", "not callable"),
    ],
)
def test_errors_name_the_path_and_problem(path, words):
    with pytest.raises(ValueError, match=words) as info:
        load_callable(path)
    assert repr(path) in str(info.value) or path in (None, "")
