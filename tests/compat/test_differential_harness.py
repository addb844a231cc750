"""The differential harness (tests/differential.py) itself: what it counts as the same outcome."""

import torch
from differential import describe, differences


def outcome(returned=None, raised=None, warnings=()):
    base = {"warnings": sorted(warnings)}
    if raised is not None:
        return {**base, "raised": [cls.__name__ for cls in raised.__mro__], "message": "m"}
    return {**base, "returned": describe(returned)}


class ClearerValueError(ValueError):
    pass


def test_equal_tensors_and_containers_agree_and_any_change_is_named():
    value = {"a": torch.arange(3.0), "b": (1, [torch.ones(2, dtype=torch.int8)])}
    assert differences(outcome(value), outcome(value)) == []
    changed = {"a": torch.tensor([0.0, 1.0, 2.5]), "b": (1, [torch.ones(2, dtype=torch.int8)])}
    assert any("values differ" in line for line in differences(outcome(value), outcome(changed)))
    as_list = {"a": torch.arange(3.0), "b": [1, [torch.ones(2, dtype=torch.int8)]]}
    assert differences(outcome(value), outcome(as_list)), "a tuple returned as a list is a difference"
    assert differences(outcome(torch.ones(2)), outcome(torch.ones(2, dtype=torch.float64))), "dtype is compared"


def test_floats_compare_exactly_unless_a_tolerance_is_given():
    assert differences(outcome(torch.tensor([1.0])), outcome(torch.tensor([1.0 + 1e-6])))
    assert differences(outcome(torch.tensor([1.0])), outcome(torch.tensor([1.0 + 1e-6])), atol=1e-5) == []
    assert differences(outcome(float("nan")), outcome(float("nan"))) == []


def test_an_exception_must_be_an_instance_of_the_references_type():
    assert differences(outcome(raised=ValueError), outcome(raised=ClearerValueError)) == []
    assert differences(outcome(raised=ValueError), outcome(raised=TypeError))
    assert differences(outcome(raised=ValueError), outcome(1))
    assert differences(outcome(1), outcome(raised=ValueError))


def test_warning_categories_are_compared():
    assert differences(outcome(1, warnings=["UserWarning"]), outcome(1)) == [
        "warnings: Accelerate ['UserWarning'], hasten []"
    ]
