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
