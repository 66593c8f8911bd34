"""The restart count is read one way everywhere (issue 16 item 12): the Trainer's elastic resume and the
torch backend's per-restart store keys agree, and a value that is not a count is a one-line error."""

from __future__ import annotations

import pytest

from polytrain.environments import restart_count
from polytrain.errors import EnvironmentDetectionError


@pytest.mark.parametrize(("env", "count"), [
    ({}, 0),
    ({"TORCHELASTIC_RESTART_COUNT": "2"}, 2),
    ({"POLYTRAIN_RESTART_COUNT": "3"}, 3),
    # polytrain's local launcher under torchrun: both set; the larger wins, whichever variable holds it
    ({"TORCHELASTIC_RESTART_COUNT": "0", "POLYTRAIN_RESTART_COUNT": "1"}, 1),
    ({"TORCHELASTIC_RESTART_COUNT": "4", "POLYTRAIN_RESTART_COUNT": "1"}, 4),
    ({"TORCHELASTIC_RESTART_COUNT": " ", "POLYTRAIN_RESTART_COUNT": ""}, 0),
])
def test_the_count_is_the_largest_variable_set(env: dict[str, str], count: int) -> None:
    assert restart_count(env) == count


@pytest.mark.parametrize("value", ["one", "-1", "1.5", "²"])
def test_a_value_that_is_not_a_count_names_the_variable(value: str) -> None:
    with pytest.raises(EnvironmentDetectionError) as info:
        restart_count({"POLYTRAIN_RESTART_COUNT": value})
    assert str(info.value).startswith(f"POLYTRAIN_RESTART_COUNT={value!r}: a restart count must be a non-negative "
                                      f"integer")
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


def test_the_backend_store_keys_follow_the_same_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the backend took the first variable set ("0") while the Trainer took the larger (1): a restarted
    worker's keys then collided with the first attempt's."""
    pytest.importorskip("torch")
    from polytrain.adapters.torch import rendezvous
    from polytrain.adapters.torch.backend import store_prefix

    monkeypatch.setattr(rendezvous, "_groups", 1)  # this process's first process group
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("POLYTRAIN_RESTART_COUNT", "1")
    assert store_prefix() == "polytrain/restart_1"
    monkeypatch.setattr(rendezvous, "_groups", 2)  # its second: keys of its own (the first group's are stale)
    assert store_prefix() == "polytrain/restart_1/group_2"
    monkeypatch.setenv("POLYTRAIN_RESTART_COUNT", "x")
    with pytest.raises(EnvironmentDetectionError, match="POLYTRAIN_RESTART_COUNT='x'"):
        store_prefix()
