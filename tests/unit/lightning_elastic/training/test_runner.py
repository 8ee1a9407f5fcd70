"""@le.run applied or called wrongly: a TypeError saying how to use it, not an AttributeError."""

from __future__ import annotations

import pytest

import lightning_elastic as le
from tests.troubleshooting_rows import assert_documented


def train(state, steps=1):
    return steps


@pytest.mark.parametrize(
    ("args", "got"),
    [((), "no argument"), ((object(),), "object"), (({"step": 0},), "dict")],
)
def test_calling_without_a_state_first_says_what_it_takes(args, got):
    with pytest.raises(TypeError) as info:
        le.run(train)(*args)
    assert str(info.value) == (
        "train, decorated with @le.run, takes a lightning_elastic state as its first argument "
        f"(le.TorchState, le.ObjectState, le.FabricState), got {got}: call train(state, ...)"
    )
    assert_documented(f"TypeError: {info.value}")


def test_a_decorated_method_says_to_decorate_a_function_of_the_state():
    class Loop:
        @le.run
        def fit(self, state):
            return state

    with pytest.raises(TypeError, match=r"got Loop: call fit\(state, \.\.\.\); on a method, decorate a function "
                                        r"whose first argument is the state$"):
        Loop().fit(le.ObjectState(worker=None))


@pytest.mark.parametrize(("value", "got"), [(None, "nothing"), (le.ObjectState(worker=None), "ObjectState")])
def test_run_given_something_else_than_a_function_says_how_to_write_it(value, got):
    with pytest.raises(TypeError) as info:
        le.run(value) if value is not None else le.run()
    assert str(info.value) == (
        f"@le.run: expected the training function, got {got}: write @le.run (no parentheses) "
        "above def train(state, ...), then call train(state)"
    )
    assert_documented(f"TypeError: {info.value}")


class _FakeState:
    """What ``@le.run``'s recovery asks of a state, with the job's commit count as ObjectState keeps it."""

    def __init__(self, commits: int, rank: int = 0) -> None:
        from types import SimpleNamespace

        self._commits = commits
        self.worker = SimpleNamespace(assignment=SimpleNamespace(rank=rank), resume_from=None)

    def resume_from_snapshot(self):
        return None

    def on_reset(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def restore(self) -> None:
        pass

    def keep_live(self) -> None:
        pass


HINT = "nothing was committed since training started"


@pytest.mark.parametrize(("commits", "rank", "said"), [(0, 0, True), (3, 0, False), (0, 1, False)])
def test_a_failure_restoring_the_constructed_state_says_to_commit_once_on_rank_0(caplog, commits, rank, said):
    from lightning_elastic.training.runner import _StateRecovery

    recovery = _StateRecovery(_FakeState(commits, rank), lambda: None)
    recovery.prepare(False)
    for _ in range(2):  # two failures: said once
        recovery.restore_commit()
        recovery.prepare(True)
    hints = [r.getMessage() for r in caplog.records if HINT in r.getMessage()]
    assert len(hints) == (1 if said else 0), [r.getMessage() for r in caplog.records]
    if hints:
        assert_documented(hints[0])


def test_a_host_change_before_any_commit_gives_no_hint(caplog):
    from lightning_elastic.training.runner import _StateRecovery

    recovery = _StateRecovery(_FakeState(0), lambda: None)
    recovery.prepare(False)
    recovery.keep_live_state()
    recovery.prepare(True)
    assert not [r for r in caplog.records if HINT in r.getMessage()]
