"""Allocation-site placement in one process (rdmaflow.graph.placement).

A phase's first call records its allocations; ``learn`` makes the op of a sent tensor a site;
``settle`` keeps the sites or declines them when the mode would cost more than the copies they
save. Checked on a real arena: where a later call's output is born, that autograd through a
placed op gives the same gradients, and which phases are declined. The stages that use this
are tested end to end in test_graph_jobs.py.
"""
from __future__ import annotations

import pytest
import torch
from conftest import local_device

from rdmaflow.bench.pipeline_models import Block, ResidualNorm
from rdmaflow.errors import InvalidArgumentError
from rdmaflow.graph.placement import COSTS_ENV, Placement, copy_cost, mode_cost_per_op


@pytest.fixture(scope="module")
def arena():
    with local_device(secret="placement-test-secret") as dev:
        dev.create_arena(64 << 20)
        yield dev.arena


def forward_backward(placement: Placement, model, x, grads_to: list):
    """One forward phase then one backward phase, as a stage runs them; returns the output and
    the gradient of the input."""
    leaf = x.detach().requires_grad_()
    out = placement.run("forward", model, leaf)
    placement.run("backward", torch.autograd.backward, [out], [torch.ones_like(out)])
    grads_to.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    return out, leaf.grad


def test_the_calibrations_measure_something():
    assert mode_cost_per_op() > 0
    assert copy_cost(1 << 20) > copy_cost(64) > 0


def test_few_ops_and_a_large_output_are_placed_and_train_the_same(arena):
    """A residual block over a 8 MiB activation: a handful of ops under the mode against a copy
    of 8 MiB each way, so both phases keep their sites and later outputs are born in the arena."""
    torch.manual_seed(0)
    model, x = ResidualNorm(32768), torch.randn(64, 32768)
    p, plain = Placement(arena), []
    out, gin = forward_backward(p, model, x, plain)
    assert p.learn("forward", out) is None and p.learn("backward", gin) is None
    assert p.settle("forward") is None and p.settle("backward") is None
    assert p.phases["forward"].ops > 0 and p.phases["forward"].sites and p.phases["backward"].sites
    placed = []
    out2, gin2 = forward_backward(p, model, x, placed)
    assert arena.offset_of(out2) is not None and arena.offset_of(gin2) is not None
    assert p.placed == 2 and p.misses == 0
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(gin2, gin)
    for a, b in zip(placed[0], plain[0], strict=True):
        torch.testing.assert_close(a, b)


def test_many_ops_and_a_small_output_are_declined_and_say_why(arena):
    """Two transformer blocks over 1 KiB: about a hundred ops per phase under the mode to save a
    copy of 1 KiB. Both phases are declined, run without the mode, and train the same."""
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(Block(16, 2), Block(16, 2)), torch.randn(1, 16, 16)
    p, plain = Placement(arena), []
    out, gin = forward_backward(p, model, x, plain)
    assert p.learn("forward", out) is None and p.learn("backward", gin) is None
    for phase in ("forward", "backward"):
        why = p.settle(phase)
        assert why is not None and why.startswith("placement declined") and f"{p.phases[phase].ops} ops" in why
        assert not p.phases[phase].sites
        assert p.settle(phase) is None  # decided once
    placed = []
    out2, gin2 = forward_backward(p, model, x, placed)
    assert arena.offset_of(out2) is None and arena.offset_of(gin2) is None and p.placed == 0
    torch.testing.assert_close(gin2, gin)
    for a, b in zip(placed[0], plain[0], strict=True):
        torch.testing.assert_close(a, b)


def test_without_weighing_every_site_is_placed(arena):
    """``weigh=False`` (a stage built with zero_copy="always"): the same small phases keep their sites."""
    model, x = torch.nn.Sequential(Block(16, 2), Block(16, 2)), torch.randn(1, 16, 16)
    p = Placement(arena, weigh=False)
    out, gin = forward_backward(p, model, x, [])
    assert p.learn("forward", out) is None and p.learn("backward", gin) is None
    assert p.settle("forward") is None and p.settle("backward") is None
    out2, gin2 = forward_backward(p, model, x, [])
    assert arena.offset_of(out2) is not None and arena.offset_of(gin2) is not None and p.placed == 2


def test_given_costs_decide_instead_of_the_measured_ones(arena, monkeypatch):
    """$RDMAFLOW_PLACEMENT_COSTS turns the decision around both ways: the small transformer
    phases are kept when an op under the mode is free, and the 8 MiB residual phases are
    declined when an op costs a second."""
    monkeypatch.setenv(COSTS_ENV, "mode_us_per_op=0,copy_gb_per_s=1")
    assert mode_cost_per_op() == 0 and copy_cost(10**9) == pytest.approx(1.0)
    model, x = torch.nn.Sequential(Block(16, 2), Block(16, 2)), torch.randn(1, 16, 16)
    p = Placement(arena)
    out, gin = forward_backward(p, model, x, [])
    assert p.learn("forward", out) is None and p.learn("backward", gin) is None
    assert p.settle("forward") is None and p.settle("backward") is None
    monkeypatch.setenv(COSTS_ENV, " copy_gb_per_s=100 , mode_us_per_op=1e6")
    p = Placement(arena)
    out, gin = forward_backward(p, ResidualNorm(32768), torch.randn(64, 32768), [])
    assert p.learn("forward", out) is None and p.learn("backward", gin) is None
    assert p.settle("forward").startswith("placement declined") and p.settle("backward").startswith("placement declined")


@pytest.mark.parametrize("text", ["mode_us_per_op=5", "mode_us_per_op=5,copy_gb_per_s=0", "mode_us_per_op=-1,copy_gb_per_s=2",
                                  "mode_us_per_op=x,copy_gb_per_s=2", "mode_us_per_op=5,copy_gb_per_s=2,copy_gb_per_s=3",
                                  "mode=5,copy_gb_per_s=2", "mode_us_per_op=nan,copy_gb_per_s=2", "5,2"])
def test_malformed_given_costs_fail_when_the_placement_is_made(arena, monkeypatch, text):
    monkeypatch.setenv(COSTS_ENV, text)
    with pytest.raises(InvalidArgumentError, match=COSTS_ENV):
        Placement(arena)
    Placement(arena, weigh=False)  # a placement that weighs nothing does not read them
