"""A hand-written loop's checkpoint keeps plain values exactly (issue 48 item 15): infinities and NaN, tuples and
dicts keyed by numbers come back as they were, in a manifest that stays strict JSON — and so every LR scheduler of
``torch.optim.lr_scheduler`` can be saved. The scheduler classes are found in the module, so one a new torch adds
fails here until it is given a way to be built (`BUILD`)."""

from __future__ import annotations

import copy
import inspect
import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from polytrain.observe import jsonfiles as jsonfiles

torch = pytest.importorskip("torch")
from torch.optim import lr_scheduler as schedulers  # noqa: E402

from polytrain.checkpoint.store import CheckpointError  # noqa: E402
from polytrain.torch import Distributed  # noqa: E402

Build = Callable[[Any], Any]


def strict(text: str) -> Any:
    """JSON as strict parsers read it: no bare NaN/Infinity."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (Counter is not dict, tuple is not list, 1.0 is not 1) and NaN
    equal to a NaN of the same sign. (A dict's order is not compared: manifests are written with sorted keys.)"""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b) and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


TRICKY = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "-nan": -math.nan, "tuple": (1, 2.0, ("x", None)),
          "counter": Counter({30: 1, 80: 2}), "by_int": {1: "a", 2: [True, False]}, "$float": "inf",
          "$$key": {"$tuple": [1]}, "nested": [{"$items": []}, (math.inf,)], "big": 2**70, "float": 1.0}


def test_exact_round_trips_every_kind_of_plain_value_in_strict_json() -> None:
    text = json.dumps(jsonfiles.exact(TRICKY), allow_nan=False)
    back = jsonfiles.unexact(strict(text))
    assert same(back, TRICKY), back
    assert same(jsonfiles.unexact(jsonfiles.exact([TRICKY, (TRICKY,)])), [TRICKY, (TRICKY,)])
    # what plain JSON already holds is written as it is
    assert jsonfiles.exact({"a": [1, 2.5, "s", None, True]}) == {"a": [1, 2.5, "s", None, True]}


def test_exact_names_what_is_not_plain_and_unexact_refuses_a_tag_it_did_not_write() -> None:
    with pytest.raises(jsonfiles.NotPlain, match=r"^'note'\['a'\]\[1\] is a set$"):
        jsonfiles.exact({"a": [1, {2}]}, "'note'")
    with pytest.raises(ValueError, match=r"expected one of inf, -inf, nan, -nan"):
        jsonfiles.unexact({"$float": "infinity"})
    with pytest.raises(ValueError, match=r"not a list"):
        jsonfiles.unexact({"$tuple": 3})


def test_a_loop_saves_inf_nan_tuples_and_int_keys_and_names_what_it_cannot(tmp_path: Path) -> None:
    """Through the real own loop: the values come back with their types, the manifest is strict JSON, and a value
    that is not plain data is one line naming where it is (no "it is a float; a checkpoint holds numbers")."""
    with Distributed("local") as dist:
        model = torch.nn.Linear(2, 1)
        model, optimizer = dist.setup(model, torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9)))
        saved = dist.save(tmp_path, {"model": model, "optimizer": optimizer, "step": 1, "best_val_loss": math.inf,
                                     "tricky": TRICKY})
        with pytest.raises(CheckpointError, match=r"^save: 'note'\['a'\] is a set; a checkpoint holds the model, "):
            dist.save(tmp_path, {"model": model, "note": {"a": {1}}})
    manifest = strict((saved / "manifest.json").read_text())
    assert manifest["loop_state"]["best_val_loss"] == {"$float": "inf"}
    assert manifest["optimizer_groups"][0]["betas"] == {"$tuple": [0.8, 0.9]}
    with Distributed("local") as dist:
        fresh = torch.nn.Linear(2, 1)
        fresh, opt = dist.setup(fresh, torch.optim.Adam(fresh.parameters(), lr=0.5))
        values = dist.load(tmp_path, {"model": fresh, "optimizer": opt})
        assert values["best_val_loss"] == math.inf and same(values["tricky"], TRICKY)
        assert same(opt.param_groups[0]["betas"], (0.8, 0.9)) and opt.param_groups[0]["lr"] == 0.1


# How each scheduler class is built on an SGD optimizer with momentum (lr 0.1), and how many steps it takes before
# the save; several ways for a class where its state differs (ReduceLROnPlateau: inf, or -inf before a first step).
BUILD: dict[str, list[tuple[str, Build, int]]] = {
    "LambdaLR": [("", lambda o: schedulers.LambdaLR(o, lambda e: 0.9 ** e), 4)],
    "MultiplicativeLR": [("", lambda o: schedulers.MultiplicativeLR(o, lambda e: 0.95), 4)],
    "StepLR": [("", lambda o: schedulers.StepLR(o, 2, 0.5), 3)],
    "MultiStepLR": [("", lambda o: schedulers.MultiStepLR(o, [2, 5, 5, 7], 0.5), 3)],
    "ConstantLR": [("", lambda o: schedulers.ConstantLR(o, 0.5, 5), 3)],
    "LinearLR": [("", lambda o: schedulers.LinearLR(o, 0.2, 1.0, 6), 3)],
    "ExponentialLR": [("", lambda o: schedulers.ExponentialLR(o, 0.9), 3)],
    "SequentialLR": [("", lambda o: schedulers.SequentialLR(
        o, [schedulers.LinearLR(o, 0.2, 1.0, 3), schedulers.ExponentialLR(o, 0.9)], [3]), 2)],
    "CosineAnnealingLR": [("", lambda o: schedulers.CosineAnnealingLR(o, 6, 0.01), 3)],
    "ChainedScheduler": [("", lambda o: schedulers.ChainedScheduler(
        [schedulers.ConstantLR(o, 0.5, 4), schedulers.ExponentialLR(o, 0.9)]), 2)],
    "ReduceLROnPlateau": [("min", lambda o: schedulers.ReduceLROnPlateau(o, patience=1, factor=0.5), 4),
                          ("max-before-a-step", lambda o: schedulers.ReduceLROnPlateau(
                              o, mode="max", patience=0, threshold_mode="abs"), 0)],
    "CyclicLR": [("", lambda o: schedulers.CyclicLR(o, 0.01, 0.1, step_size_up=2, mode="exp_range", gamma=0.9), 3)],
    "CosineAnnealingWarmRestarts": [("", lambda o: schedulers.CosineAnnealingWarmRestarts(o, 2, 2, 0.01), 3)],
    "OneCycleLR": [("", lambda o: schedulers.OneCycleLR(o, 0.2, total_steps=12), 4)],
    "PolynomialLR": [("", lambda o: schedulers.PolynomialLR(o, 7, 2.0), 3)],
}
AFTER = 7  # steps taken after the save, by the run that goes on and by the resumed one
METRIC = [1.0, 0.9, 0.95, 0.97, 0.99, 0.8, 0.85, 0.9, 0.95, 1.0, 1.1, 0.7]  # ReduceLROnPlateau's validation loss


def scheduler_classes() -> list[str]:
    """Every scheduler ``torch.optim.lr_scheduler`` offers (its public classes but the abstract base)."""
    return sorted(name for name in schedulers.__all__ if inspect.isclass(cls := getattr(schedulers, name))
                  and hasattr(cls, "state_dict") and hasattr(cls, "step") and cls is not schedulers.LRScheduler)


def test_every_scheduler_class_has_a_way_to_be_built() -> None:
    found = scheduler_classes()
    assert "ReduceLROnPlateau" in found and "MultiStepLR" in found and len(found) >= 14
    assert sorted(BUILD) == found, f"give BUILD a way to build {sorted(set(found) - set(BUILD))}"


def steps(dist: Distributed, model: Any, optimizer: Any, scheduler: Any, first: int, count: int) -> list[float]:
    """``count`` training steps from step ``first``; the learning rates the optimizer had after each."""
    lrs = []
    for step in range(first, first + count):
        dist.backward(model(torch.ones(1, 2)).pow(2).sum())
        optimizer.step()
        optimizer.zero_grad()
        if isinstance(scheduler, schedulers.ReduceLROnPlateau):
            scheduler.step(METRIC[step])
        else:
            scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def setup(dist: Distributed, build: Build) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return model, optimizer, build(optimizer.optimizer)


@pytest.mark.parametrize(("name", "build", "before"), [
    pytest.param(name, build, before, id=f"{name}-{label}" if label else name)
    for name in scheduler_classes() for label, build, before in BUILD.get(name, [("", None, 0)])])
def test_a_scheduler_saved_mid_schedule_goes_on_as_if_the_run_had_not_stopped(
        tmp_path: Path, name: str, build: Build | None, before: int) -> None:
    assert build is not None, f"no way to build {name}: add it to BUILD"
    with Distributed("local") as dist:
        model, optimizer, scheduler = setup(dist, build)
        steps(dist, model, optimizer, scheduler, 0, before)
        dist.save(tmp_path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": before})
        state = copy.deepcopy(scheduler.state_dict())
        going_on = steps(dist, model, optimizer, scheduler, before, AFTER)
    with Distributed("local") as dist:
        model, optimizer, scheduler = setup(dist, build)
        assert dist.load(tmp_path, {"model": model, "optimizer": optimizer, "scheduler": scheduler})["step"] == before
        assert same(scheduler.state_dict(), state), (scheduler.state_dict(), state)
        resumed = steps(dist, model, optimizer, scheduler, before, AFTER)
    assert resumed == going_on
    assert len(set(going_on)) > 1 or name == "ReduceLROnPlateau" and before == 0  # the schedule moves on
