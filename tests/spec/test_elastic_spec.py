"""The ``elastic`` table (issue 51.1, 51.7): its defaults, its rules, one line naming the field."""

from __future__ import annotations

import pytest

from polytrain.errors import SpecError
from polytrain.spec.elastic import ElasticSpec
from polytrain.validation import from_dict


def test_defaults_and_no_effect_on_the_digest():
    spec = from_dict({"elastic": {}})
    assert spec.elastic == ElasticSpec(min_np=1, max_np=None, commit_every_n_steps=1)
    assert from_dict({}).elastic is None
    # where and how a job survives a lost rank is not what it trains: a resumed run's digest is unchanged
    assert spec.digest() == from_dict({}).digest()
    assert from_dict({"elastic": {"min_np": 2, "max_np": 2, "commit_every_n_steps": 5}}).elastic.max_np == 2


@pytest.mark.parametrize(("raw", "expected"), [
    ({"elastic": {"min_np": 3, "max_np": 2}}, "elastic.min_np: 3 is more than elastic.max_np 2"),
    ({"elastic": {"commit_every_n_steps": 0}}, "elastic.commit_every_n_steps: 0 is out of range (must be >= 1)"),
    ({"elastic": {"min_np": 0}}, "elastic.min_np: 0 is out of range (must be >= 1)"),
    ({"elastic": {"max_np": 0}}, "elastic.max_np: 0 is out of range (must be >= 1)"),
    ({"elastic": {"np": 2}}, "elastic.np: unknown field"),
    ({"elastic": {}, "backend": "deepspeed"}, "elastic: backend 'deepspeed' cannot recover in place yet"),
    ({"elastic": {}, "framework": "tensorflow"}, "elastic: in-place recovery is PyTorch's in this version"),
])
def test_bad_tables_are_one_line(raw, expected):
    with pytest.raises(SpecError) as info:
        from_dict(raw)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
