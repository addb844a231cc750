"""Fixtures of the strategy tests."""

import importlib.machinery
import sys
import types

import pytest

pytest.register_assert_rewrite("strategies.contract")  # the contract's asserts explain themselves as tests' do


@pytest.fixture
def deepspeed(request, monkeypatch):
    """The ``deepspeed`` module a test sees: a stand-in, installed DeepSpeed or not, unless the test is marked
    ``requires("deepspeed")``, which gets the real package.

    The stand-in is found by ``importlib.util.find_spec`` (so ``DeepSpeedPlugin`` can be built) but holds nothing,
    and every real ``deepspeed.*`` module is hidden for the test: a test passes only if the logic it checks needs
    nothing of DeepSpeed, and so runs where DeepSpeed is not installed. Tests give it what they need
    (``monkeypatch.setattr(deepspeed, "initialize", ..., raising=False)``).
    """
    if any("deepspeed" in mark.args for mark in request.node.iter_markers("requires")):
        import deepspeed as installed

        return installed
    for name in [name for name in sys.modules if name.startswith("deepspeed.")]:
        monkeypatch.setitem(sys.modules, name, None)
    stand_in = types.ModuleType("deepspeed")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed", stand_in)
    return stand_in
