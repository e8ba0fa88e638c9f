"""The worker's bookkeeping of what a step wrote of its gradient (rdmaflow.ps.step_gradients),
without a job: which units a hook makes ready, and which step() must write again after a second
backward, a discarded one, a change between backward and step(), or push_range's ranges. The
jobs in test_ps.py check the same cases end to end against torch."""
from __future__ import annotations

import torch

from rdmaflow.ps.layout import Unit
from rdmaflow.ps.step_gradients import StepGradients

# Three parameters over four units: parameter 0 is unit 0; parameter 1 is units 1 and 2; unit 2
# also holds parameter 2 (small parameters packed into one unit).
UNITS_OF_PARAM = [[0], [1, 2], [2, 3]]
SIZES = [4, 3, 3]  # elements of each parameter in the flat buffer


def flat_views():
    """A send buffer and each parameter's gradient as a view of it (zero copy)."""
    buf = torch.zeros(sum(SIZES))
    return buf, list(torch.split(buf, SIZES))


def backward(sg: StepGradients, buf: torch.Tensor, grads, order=(2, 1, 0)) -> list[int]:
    """Accumulates ones into each gradient in ``order`` and runs its hook; the units made ready."""
    ready = []
    for i in order:
        grads[i].add_(1.0)
        ready += sg.hook(i, grads[i], buf._version)
        sg.written.update(ready)  # the worker writes what a hook makes ready
    return ready


def test_a_unit_is_ready_once_every_parameter_in_it_has_its_gradient():
    sg = StepGradients(UNITS_OF_PARAM, 4, zero_copy=True)
    buf, grads = flat_views()
    grads[2].add_(1.0)
    assert sg.hook(2, grads[2], buf._version) == [3]  # unit 2 waits for parameter 1
    grads[1].add_(1.0)
    assert sg.hook(1, grads[1], buf._version) == [1, 2]
    sg.written.update([1, 2, 3])
    assert sg.to_write() == [0]
    assert sg.changed(grads, buf._version) == []  # nothing changed after the hooks


def test_a_second_backward_writes_again_every_unit_written_before():
    sg = StepGradients(UNITS_OF_PARAM, 4, zero_copy=True)
    buf, grads = flat_views()
    assert sorted(backward(sg, buf, grads)) == [0, 1, 2, 3]
    assert backward(sg, buf, grads) == []  # accumulated: nothing new, everything dirty
    assert sg.dirty == {0, 1, 2, 3}
    assert sg.to_write() == [0, 1, 2, 3]


def test_the_models_in_place_zero_between_two_backwards_rewrites_what_only_the_first_reached():
    """The model's zero_grad(set_to_none=False) is invisible to the worker; the second backward
    reaches parameters 1 and 2 only. Unit 0, written by the first, holds zeros now: it must be
    written again, though no hook of the second backward touched it."""
    sg = StepGradients(UNITS_OF_PARAM, 4, zero_copy=True)
    buf, grads = flat_views()
    backward(sg, buf, grads)
    buf.zero_()
    backward(sg, buf, grads, order=(2, 1))
    assert 0 not in sg.dirty
    assert sg.changed(grads, buf._version) == [0, 1, 2]
    for i in sg.changed(grads, buf._version):
        sg.rewrite(i)
    assert sg.to_write() == [0, 1, 2, 3]


def test_a_discarded_backward_rewrites_its_units_and_waits_for_the_hooks_anew():
    sg = StepGradients(UNITS_OF_PARAM, 4, zero_copy=True)
    buf, grads = flat_views()
    backward(sg, buf, grads, order=(2, 1))  # units 1, 2, 3 written; unit 0 not yet
    sg.discard()
    buf.zero_()
    assert sg.fired == set() and sg.dirty == {1, 2, 3}
    grads[0].add_(1.0)
    assert sg.hook(0, grads[0], buf._version) == [0]  # counted afresh: parameter 0 alone fills unit 0
    sg.written.add(0)
    assert sg.changed(grads, buf._version) == []
    assert sg.to_write() == [1, 2, 3]  # what only the discarded backward wrote: zeros now


def test_a_gradient_changed_in_place_after_backward_is_found_with_zero_copy():
    sg = StepGradients(UNITS_OF_PARAM, 4, zero_copy=True)
    buf, grads = flat_views()
    backward(sg, buf, grads)
    grads[0].mul_(0.5)  # clip_grad_norm_: every view shares the buffer's version counter
    assert sg.changed(grads, buf._version) == [0, 1, 2]


def test_without_zero_copy_each_gradient_is_checked_on_its_own():
    sg = StepGradients(UNITS_OF_PARAM, 4, zero_copy=False)
    buf = torch.zeros(sum(SIZES))
    grads = [torch.ones(n) for n in SIZES]  # p.grad apart from the send buffer
    for i in (2, 1, 0):
        sg.written.update(sg.hook(i, grads[i], buf._version))
    assert sg.changed(grads, buf._version) == []
    grads[1].mul_(0.5)                # changed in place
    now = [torch.ones(4), grads[1], None]  # parameter 0 replaced, parameter 2 set to None
    assert sg.changed(now, buf._version) == [0, 1]
    sg.rewrite(1)
    assert sg.dirty == {1, 2}


def test_push_ranges_decide_what_is_written_once_and_what_again():
    units = [Unit(key=k, shard=0, offset=o, numel=n, shard_offset=o, name=f"u{k}")
             for k, (o, n) in enumerate([(0, 4), (4, 2), (6, 2), (8, 2)])]
    sg = StepGradients(UNITS_OF_PARAM, 4, zero_copy=True)
    sg.ranges += [(0, 4), (4, 5), (6, 8), (7, 8)]  # unit 1 half covered, unit 2 twice
    sg.apply_ranges(units)
    assert sg.written == {0} and sg.dirty == {1, 2}
    assert sg.to_write() == [1, 2, 3]


def test_reset_forgets_the_step():
    sg = StepGradients(UNITS_OF_PARAM, 4, zero_copy=True)
    buf, grads = flat_views()
    backward(sg, buf, grads)
    backward(sg, buf, grads)
    sg.reset()
    assert sg.written == set() and sg.dirty == set() and sg.fired == set() and sg.ranges == []
    assert sorted(backward(sg, buf, grads)) == [0, 1, 2, 3]
    assert sg.changed(grads, buf._version) == []
