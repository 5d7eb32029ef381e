"""A rule that breaks surfaces as an AutoparError naming the op, its inputs and the cause."""

import pytest

import autopar
from autopar.spmd import RULES, SpmdRule
from autopar.testing.models import simple_net


class BrokenRule(SpmdRule):
    def infer_forward(self, inputs, attrs, ctx):
        raise ValueError("this rule does not know the op's form")


def test_a_failing_rule_names_its_op(monkeypatch):
    monkeypatch.setitem(RULES, "relu", BrokenRule())
    net = simple_net(sizes=(16, 32, 10))
    mesh = autopar.ProcessMesh([0, 1], ["dp"])
    autopar.shard_tensor(net.feeds["x"], mesh, ["dp", None])
    with pytest.raises(autopar.AutoparError, match=r"BrokenRule failed on pd_op\.relu#\d+ \(inputs: \[8, 32\] .*ValueError: this rule does not know"):
        autopar.compile(net.main, mesh)
