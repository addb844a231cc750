"""Smoke tests of the examples, launched the way users launch them."""

import re

import pytest

from helpers import ROOT, torchrun

pytestmark = pytest.mark.slow


def test_digits_classifier_two_processes():
    out = torchrun(ROOT / "examples" / "digits_classifier.py", "--epochs", "3").stdout
    accuracies = [float(a) for a in re.findall(r"test accuracy ([0-9.]+) on 360 samples", out)]
    assert len(accuracies) == 3, out
    assert accuracies[-1] > 0.85, accuracies
