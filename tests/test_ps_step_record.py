"""The worker's step records (rdmaflow.ps.step_record), without a job: what a push's record
says, when a record is written at all, which source buffer it is encoded into, and which
optimizer changes are refused. test_ps.py checks end to end that a shard runs each push with
the record sent with it."""
from __future__ import annotations

import concurrent.futures

import pytest
import torch

import rdmaflow
from rdmaflow.ps.optim import describe_optimizer
from rdmaflow.ps.protocol import read_record, record_bytes
from rdmaflow.ps.step_record import StepRecord

PARAMS = 3


def make(opt: torch.optim.Optimizer, slots: int = 1) -> tuple[StepRecord, list[torch.Tensor]]:
    desc = describe_optimizer(opt)
    n = record_bytes(4, PARAMS)  # SGD's numeric hyperparameters: dampening, lr, momentum, weight_decay
    sources = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
    return StepRecord(desc, desc, PARAMS, slots, sources), sources


def decoded(r: StepRecord, src: torch.Tensor):
    values, has = read_record(src, len(r.fields), PARAMS)
    return (None if values is None else dict(zip([k for k, _ in r.fields], values))), has.tolist()


def sgd() -> torch.optim.SGD:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


def test_a_record_is_written_only_when_its_slot_last_got_another():
    opt = sgd()
    r, sources = make(opt)
    assert [k for k, _ in r.fields] == ["dampening", "lr", "momentum", "weight_decay"]
    every = [True] * PARAMS
    assert r.of(opt, every) == (None, every)  # the job's hyperparameters: none sent
    assert r.encode(1, r.of(opt, every), 1.0) is None, "what a shard does without a record"
    opt.param_groups[0]["lr"] = 0.05  # an LR scheduler's step
    assert r.encode(2, r.of(opt, every), 1.0) == 0
    assert decoded(r, sources[0]) == ({"dampening": 0.0, "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0}, every)
    assert r.encode(3, r.of(opt, every), 1.0) is None  # unchanged since push 2
    assert r.encode(4, r.of(opt, [True, False, True]), 1.0) == 1  # an unused parameter; the other source
    assert decoded(r, sources[1])[1] == [True, False, True]
    opt.param_groups[0]["lr"] = 0.1
    assert r.encode(5, r.of(opt, every), 1.0) == 0, "back to the job's: the slot holds 0.05, so it is said"
    assert decoded(r, sources[0]) == (None, every)


def test_with_two_push_buffers_each_slot_gets_a_changed_record_once():
    opt = sgd()
    r, _ = make(opt, slots=2)  # asynchronous overlap: pushes alternate between two slots
    opt.param_groups[0]["lr"] = 0.05
    every = [True] * PARAMS
    assert [r.encode(t, r.of(opt, every), 1.0) for t in (1, 2, 3, 4)] == [0, 1, None, None]


def test_a_source_is_encoded_again_only_once_its_last_writes_completed():
    opt = sgd()
    r, _ = make(opt)
    every = [True] * PARAMS
    opt.param_groups[0]["lr"] = 0.05
    assert r.encode(1, r.of(opt, every), 1.0) == 0
    in_flight = concurrent.futures.Future()
    r.sent(0, [in_flight])
    opt.param_groups[0]["lr"] = 0.04
    assert r.encode(2, r.of(opt, every), 1.0) == 1
    r.sent(1, [])
    opt.param_groups[0]["lr"] = 0.03
    with pytest.raises(TimeoutError):
        r.encode(3, r.of(opt, every), 0.05)  # source 0's WRITE has not completed
    in_flight.set_result(None)
    assert r.encode(3, r.of(opt, every), 1.0) == 0


def test_hyperparameters_that_are_not_numbers_and_parameter_groups_cannot_change():
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1, momentum=0.9)
    r, _ = make(opt)
    opt.param_groups[0]["nesterov"] = True
    with pytest.raises(rdmaflow.InvalidArgumentError, match=r"the optimizer's nesterov changed during training: "
                       r"only its numeric hyperparameters may \(dampening, lr, momentum, weight_decay\)"):
        r.of(opt, [True] * PARAMS)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    with pytest.raises(rdmaflow.InvalidArgumentError, match="one parameter group"):
        r.of(opt, [True] * PARAMS)
