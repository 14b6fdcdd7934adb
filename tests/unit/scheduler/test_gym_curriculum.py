"""The curriculum on synthetic accuracy streams, and the scheduler's per-task books (``task_book.py``).

Expected steps are counted by hand from the stream: with window w and threshold h a task moves up at the
first trained sample whose last w scores (at the current level) average >= h.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_async.config import load_config
from areal_async.config.gym_tasks import parse_tasks
from areal_async.scheduler.ledger import SampleRecord
from areal_async.scheduler.task_book import Curriculum, TaskBook


def feed(c: Curriculum, t: int, stream: list[float]) -> list[int]:
    """Positions (1-based) in ``stream`` at which task t moved up."""
    moved = []
    for i, score in enumerate(stream, 1):
        c.record(t, score)
        if c.due(t):
            c.advance(t)
            moved.append(i)
    return moved


def test_a_task_moves_up_when_its_moving_accuracy_reaches_the_threshold_and_stops_at_its_last_level():
    c = Curriculum([3], threshold=0.75, window=4)
    # window 4: [1,0,1,0]=.5  [0,1,0,1]=.5  [1,0,1,1]=.75 -> up at 6; then a fresh window: [1,1,1,1] -> up at 10
    # then level 2 is the last: a perfect stream moves nothing
    assert feed(c, 0, [1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]) == [6, 10]
    assert c.levels == [2] and c.accuracy(0) == 1.0


def test_a_window_must_be_full_and_partial_scores_count_by_their_value():
    c = Curriculum([2, 2], threshold=0.6, window=5)
    assert feed(c, 0, [1, 1, 1]) == []  # three perfect scores: the window of 5 is not full yet
    # task 1: [.5]*5 = .5, [.5,.5,.5,.5,.9] = .58, [.5,.5,.5,.9,1] = .68 >= .6 -> up at the 7th score
    assert feed(c, 1, [0.5, 0.5, 0.5, 0.5, 0.5, 0.9, 1.0]) == [7]
    assert c.levels == [0, 1]


def test_state_round_trips():
    c = Curriculum([3, 1], threshold=0.5, window=3)
    feed(c, 0, [1, 1, 1, 0])
    d = Curriculum([3, 1], threshold=0.5, window=3)
    d.restore(c.state())
    assert d.state() == c.state() and d.levels == [1, 0]


PRESET = str(Path(__file__).resolve().parents[3] / "configs/gym_mix.yaml")


def records(book: TaskBook, task: int, scores: list[float]) -> list[SampleRecord]:
    idxs = [i for i, t in enumerate(book.task) if t == task]
    for i in idxs:
        book.table(i)  # issued at the task's current level
    return [SampleRecord(f"s{k}", "g", "p", idxs[k % len(idxs)], score=s) for k, s in enumerate(scores)]


def make_book(max_prompt_len: int = 200, window: int = 8) -> TaskBook:
    pytest.importorskip("reasoning_gym")
    from areal_async.data.gym import GymSource

    tasks = [
        {"name": "chain_sum", "weight": 1, "config": {"max_terms": 2, "max_digits": 1}, "levels": [{"max_terms": 4}]},
        {"name": "products", "weight": 1, "config": {"max_digits": 1}},
    ]
    d = load_config(PRESET, [f"train_dataset.tasks={tasks}", f"train_dataset.curriculum.window={window}"]).train_dataset
    source = GymSource(parse_tasks(d.tasks), 20, seed=2)
    kept = list(range(len(source)))
    return TaskBook(source, kept, source.problems(), list, max_prompt_len, d.curriculum)


def test_the_book_rows_per_task_rewards_and_raises_chain_sum_with_new_prompts():
    book = make_book()  # threshold 0.8 (the default), window 8
    row = book.step_row(records(book, 0, [1, 1, 0, 0]) + records(book, 1, [1, 0, 0]))
    assert row["task/chain_sum/reward_mean"] == 0.5 and row["task/products/reward_mean"] == pytest.approx(1 / 3)
    assert row["task/chain_sum/samples_total"] == 4 and row["task/products/samples_total"] == 3
    assert row["task/chain_sum/level"] == 0 and row["task/chain_sum/level_raised"] == 0
    assert "task/products/level" not in row  # products has no levels
    row = book.step_row(records(book, 0, [1, 1, 1, 1, 1, 1]))  # window [0,0,1,1,1,1,1,1] = .75 < .8
    assert row["task/chain_sum/level_raised"] == 0 and row["task/chain_sum/accuracy_ma"] == 0.75
    assert "task/products/reward_mean" not in row and row["task/products/samples"] == 0
    row = book.step_row(records(book, 0, [1]))  # [0,1,1,1,1,1,1,1] = .875 >= .8: level 1
    assert row["task/chain_sum/level"] == 1 and row["task/chain_sum/level_raised"] == 1
    chain = [i for i, t in enumerate(book.task) if t == 0]
    terms = {book.table.problems[i].prompt.count(" + ") + book.table.problems[i].prompt.count(" - ") + 1 for i in chain}
    assert max(terms) > 2  # level 1 (max_terms 4) problems now sit in chain_sum's slots
    assert book.table(chain[0])[0] == list(book.table.problems[chain[0]].prompt)  # re-encoded (tokenize = list)


def test_samples_issued_at_the_old_level_do_not_count_toward_the_new_one():
    book = make_book(window=2)
    old = records(book, 0, [1, 1])
    book.step_row(old)  # up to level 1
    assert book.curriculum.levels[0] == 1
    row = book.step_row(old)  # trained late, issued at level 0: booked per task, not in the new window
    assert row["task/chain_sum/reward_mean"] == 1.0 and "task/chain_sum/accuracy_ma" not in row


def test_a_level_whose_prompts_do_not_fit_max_prompt_len_is_not_taken():
    book = make_book(max_prompt_len=72, window=2)  # 2-term prompts are 67-69 characters, 4-term ones longer
    row = book.step_row(records(book, 0, [1, 1]))
    assert row["task/chain_sum/level"] == 0 and row["task/chain_sum/level_capped"] == 1
    assert book.source.levels[0] == 0
