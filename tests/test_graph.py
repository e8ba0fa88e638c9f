"""rdmaflow.graph in one process: capture, partition and the RDMA-aware analysis.

Edge classes on graphs whose answers are known (static, bounded by a ``Dim`` maximum,
data-dependent, and a ``Dim`` with no maximum); the backward edges of training; the
zero-copy decision and its reasons; the arena sizing; and a model that cannot be captured
(the error names the op). The jobs that run these plans are in test_graph_jobs.py.
"""
from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import rdmaflow
from rdmaflow import graph
from rdmaflow.graph.analysis import GRADIENT, TOKEN

MB = 4


class Seq(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class TwoLinear(Seq):
    """Seq with a pipe_split() call between its layers."""

    def forward(self, x):
        h = torch.relu(self.a(x))
        graph.pipe_split()
        return self.b(h)


class NonzeroRows(torch.nn.Module):
    """Stage 0 sends the indices of the positive entries: their count depends on the data."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        idx = torch.nonzero(self.a(x) > 0)
        graph.pipe_split()
        return idx.float().sum(0)


class TransposedSend(torch.nn.Module):
    """Stage 0 sends a transposed (non-contiguous) view: the send must copy, and says so."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x).t()
        graph.pipe_split()
        return h.sum(0)


class DataDependentBranch(torch.nn.Module):
    def forward(self, x):
        if x.sum().item() > 0:  # Python control flow on a tensor's value: export cannot trace it
            return x * 2
        return x


def one_edge(plan, direction="forward"):
    edges = [e for e in plan.edges if e.direction == direction]
    assert len(edges) == 1, plan.explain()
    return edges[0]


def test_static_edges_and_their_gradients():
    pipe = graph.pipeline(TwoLinear(), (torch.randn(MB, 8),))
    assert pipe.num_stages == 2
    plan = pipe.plan(3)
    f = one_edge(plan)
    assert (f.cls, f.shape, f.dtype, f.nbytes) == (graph.STATIC, [MB, 16], "float32", MB * 16 * 4)
    assert (f.producer, f.consumer, f.mechanism, f.depth) == (0, 1, "static slot", 3)
    assert f.zero_copy, f.why
    b = one_edge(plan, "backward")
    assert (b.payload, b.producer, b.consumer, b.shape, b.cls) == (GRADIENT, 1, 0, [MB, 16], graph.STATIC)
    # inference: no backward edges, the same forward edge
    assert [e.direction for e in pipe.plan(3, training=False).edges] == ["forward"]


def test_dim_with_a_maximum_is_bounded_and_sized_at_it():
    x = torch.randn(MB, 8)
    pipe = graph.pipeline(TwoLinear(), (x,), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
    f = one_edge(pipe.plan(2))
    assert f.cls == graph.BOUNDED, f.cls_why
    assert f.max_shape == [64, 16] and f.nbytes == 64 * 16 * 4
    assert "<= 64" in f.cls_why and f.mechanism == "max slot + size"


def test_dim_without_a_maximum_is_dynamic():
    pipe = graph.pipeline(TwoLinear(), (torch.randn(MB, 8),), dynamic_shapes=({0: Dim("batch", min=2)},))
    f = one_edge(pipe.plan(2))
    assert f.cls == graph.DYNAMIC and "no declared maximum" in f.cls_why
    assert f.max_shape is None and f.mechanism == "dynamic (READ)"


def test_data_dependent_shape_is_dynamic():
    plan = graph.pipeline(NonzeroRows(), (torch.randn(MB, 8),)).plan(2)
    f = one_edge(plan)
    assert f.cls == graph.DYNAMIC and "depends on the data" in f.cls_why
    assert f.dtype == "int64" and f.shape[1] == 2
    # integer indices carry no gradient: the backward edge is a flag-only token
    b = one_edge(plan, "backward")
    assert (b.payload, b.nbytes, b.mechanism) == (TOKEN, 0, "flag only")


def test_zero_copy_reasons():
    plan = graph.pipeline(TransposedSend(), (torch.randn(MB, 8),)).plan(2)
    f = one_edge(plan)
    assert not f.zero_copy and "non-contiguous view" in f.why
    copy_mode = graph.pipeline(TwoLinear(), (torch.randn(MB, 8),)).plan(2, zero_copy=False)
    assert all(not e.zero_copy and "copy mode" in e.why for e in copy_mode.edges)
    with pytest.raises(rdmaflow.InvalidArgumentError, match=r"zero_copy must be one of .*'sometimes'"):
        graph.pipeline(TwoLinear(), (torch.randn(MB, 8),)).build_stage(0, zero_copy="sometimes")


def test_arena_holds_every_slot_in_flight():
    pipe = graph.pipeline(TwoLinear(), (torch.randn(MB, 8),))
    one, small, large = pipe.plan(1), pipe.plan(2), pipe.plan(8)
    for s in range(2):
        assert large.memory[s].receive_slots == 4 * small.memory[s].receive_slots > 0
        assert one.memory[s].receive_slots == small.memory[s].receive_slots  # two slots at least
        assert large.arena_bytes(s) > small.arena_bytes(s)
    # stage 0 receives the gradient slots, stage 1 the activation slots: both of MB x 16 floats
    assert large.memory[0].receive_slots == large.memory[1].receive_slots == 8 * MB * 16 * 4


def test_explain_has_a_row_per_edge():
    plan = graph.pipeline(TwoLinear(), (torch.randn(MB, 8),)).plan(2)
    text = plan.explain()
    for col in ("from->to", "shape/dtype", "class", "bytes", "mechanism", "send", "why"):
        assert col in text
    rows = [line for line in text.splitlines() if line.startswith(("f0 ", "b1 "))]
    assert len(rows) == 2 and "float32[4, 16]" in rows[0] and "zero-copy" in rows[0]
    assert "stage 0 arena" in text and "stage 1 arena" in text


def test_split_spec_conventions_agree():
    """A split_spec and a pipe_split() at the same place give the same plan."""
    spec = graph.pipeline(Seq(), (torch.randn(MB, 8),), split_spec={"b": graph.SplitPoint.BEGINNING}).plan(2)
    call = graph.pipeline(TwoLinear(), (torch.randn(MB, 8),)).plan(2)
    strip = [(e.direction, e.shape, e.cls, e.producer, e.consumer) for e in spec.edges]
    assert strip == [(e.direction, e.shape, e.cls, e.producer, e.consumer) for e in call.edges]


class Tied(torch.nn.Module):
    """An embedding and an output head that share their weight, as a language model's do."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.relu(self.mid(self.emb(idx))))


def test_tied_weights_across_stages_are_refused_naming_both():
    """A trained parameter used by two stages would be trained by neither stage's optimizer
    alone: refused at capture, with both of the names the user knows it by."""
    idx = torch.randint(0, 10, (MB, 3))
    with pytest.raises(graph.CaptureError, match=r"parameter '(emb|head)\.weight' \(also '(emb|head)\.weight'\) is "
                                                 r"trained and used by stages \[0, 1\]: a tensor shared across stages "
                                                 r"\(tied weights\)"):
        graph.pipeline(Tied(), (idx,), split_spec={"mid": graph.SplitPoint.BEGINNING})


def test_frozen_tied_weights_are_held_by_each_stage():
    """Nothing trains a frozen parameter, so each stage holds the model's own tensor under its
    name (training with a constant buffer and a frozen parameter shared: test_graph_jobs.py)."""
    model = Tied()
    model.emb.weight.requires_grad_(False)
    pipe = graph.pipeline(model, (torch.randint(0, 10, (MB, 3)),), split_spec={"mid": graph.SplitPoint.BEGINNING})
    held = [s.params for s in pipe.stages]
    shared = set(held[0]) & set(held[1])
    assert len(shared) == 1 and all(h[next(iter(shared))] is model.emb.weight for h in held)


class CountsCalls(torch.nn.Module):
    """A buffer stage 0 reads and stage 1 updates in place: stage 0's process never sees it."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        h = self.a(x) * self.calls
        graph.pipe_split()
        self.calls[()].add_(1)  # through a view
        return self.b(h)


class ReadsRunningMean(torch.nn.Module):
    """Stage 0's batch norm updates its running mean, which stage 1 reads (batch_norm's schema
    does not say it writes)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.bn(self.a(x))
        graph.pipe_split()
        return self.b(h) + self.bn.running_mean[:4]


@pytest.mark.parametrize("model,name", [(CountsCalls, "calls"), (ReadsRunningMean, "bn.running_mean")])
def test_a_buffer_updated_in_place_and_used_by_two_stages_is_refused(model, name):
    with pytest.raises(graph.CaptureError, match=rf"buffer '{name}' is updated in place by the model and used by "
                                                 r"stages \[0, 1\]: each stage runs in its own process"):
        graph.pipeline(model(), (torch.randn(MB, 8),))


def test_bad_split_specs():
    with pytest.raises(graph.CaptureError, match="'nope', which is not a submodule"):
        graph.pipeline(TwoLinear(), (torch.randn(MB, 8),), split_spec={"nope": graph.SplitPoint.BEGINNING})
    with pytest.raises(graph.CaptureError, match="stage 0 has no computation"):
        graph.pipeline(TwoLinear(), (torch.randn(MB, 8),), split_spec={"a": graph.SplitPoint.BEGINNING})

    class Layers(torch.nn.Module):  # a ModuleList is iterated, never called
        def __init__(self):
            super().__init__()
            self.ls = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])

        def forward(self, x):
            for layer in self.ls:
                x = torch.relu(layer(x))
            return x

    # It was ignored: a one-stage pipeline, refused later as a mismatch with WORLD_SIZE.
    with pytest.raises(graph.CaptureError, match=r"split_spec\['ls'\] put no split point in the model: its forward "
                                                 r"never ran .* name one of its children, e.g. 'ls.1'"):
        graph.pipeline(Layers(), (torch.randn(MB, 8),), split_spec={"ls": graph.SplitPoint.BEGINNING})
    assert graph.pipeline(Layers(), (torch.randn(MB, 8),), split_spec={"ls.1": graph.SplitPoint.BEGINNING}).num_stages == 2


def test_capture_arguments_are_refused_by_name():
    """Arguments torch.export would fail on deep inside (the error blamed a line of inspect.py or
    contextlib.py, or said "the model failed: IndexError") are refused naming the argument."""
    x = torch.randn(MB, 8)
    with pytest.raises(graph.CaptureError, match=r"mb_args and mb_kwargs \(one microbatch's inputs, 0 positional, "
                                                 r"keywords \[\]\) do not fit Seq.forward: missing a required "
                                                 r"argument: 'x'"):
        graph.pipeline(Seq(), ())
    with pytest.raises(graph.CaptureError, match="split_spec must be a dict .* got list"):
        graph.pipeline(Seq(), (x,), split_spec=["a"])
    for bad in (2, -3, "0", True):
        with pytest.raises(graph.CaptureError, match=rf"dynamic_shapes\[0\] names dimension {bad!r} of input 0, "
                                                     r"which has 2 \(0 to 1"):
            graph.pipeline(Seq(), (x,), dynamic_shapes=({bad: Dim("b", max=64)},))
    with pytest.raises(graph.CaptureError, match="takes a torch.nn.Module, got function"):
        graph.pipeline(lambda x: x, (x,))
    graph.pipeline(Seq(), (x,), dynamic_shapes=({-2: Dim("b", max=64)},))  # counted from the end: the batch


def test_uncapturable_model_names_the_op():
    with pytest.raises(graph.CaptureError) as info:
        graph.pipeline(DataDependentBranch(), (torch.randn(MB, 8),))
    msg = str(info.value)
    assert "torch.export cannot capture the model" in msg
    assert "item" in msg and "test_graph.py" in msg, msg


class FixedView(Seq):
    """Reshapes to a fixed batch of 4: a Dim on the batch is specialized away."""

    def forward(self, x):
        return self.b(self.a(x)).view(4, 2, 2)


def test_a_capture_error_keeps_what_torch_export_explained():
    """torch.export's first line says only "Constraints violated"; the lines after it say which
    Dim was specialized and the fix (they were cut off)."""
    with pytest.raises(graph.CaptureError, match=r"(?s)Constraints violated \(b\)!.*\n\s+- You marked b as dynamic but "
                                                 r"your code specialized it to be a constant \(4\).*\n\s+b = 4"):
        graph.pipeline(FixedView(), (torch.randn(MB, 8),), dynamic_shapes=({0: Dim("b", max=64)},))


class Heads(torch.nn.Module):
    """Stage 1 reshapes by the sequence length, a size read off the model input in stage 0."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        n, s, _ = x.shape
        h = self.a(x)
        graph.pipe_split()
        return self.b(h.view(n, s, 2, 4))


def test_a_size_used_by_a_later_stage_is_read_there_and_inputs_keep_their_bounds():
    pipe = graph.pipeline(Heads(), (torch.randn(2, 24, 8),), dynamic_shapes=({1: Dim("seq", min=16, max=512)},))
    plan = pipe.plan(2)
    assert [e.cls for e in plan.edges] == [graph.BOUNDED, graph.BOUNDED], plan.explain()  # no SymInt crosses
    sizes = [n for n in pipe.stages[1].module.graph.nodes if n.target == torch.ops.aten.sym_size.int]
    assert sizes and all(n.args[0].op == "placeholder" for n in sizes)
    assert plan.input_ranges == [[[2, 2], [16, 512], [8, 8]]]
    assert plan.to_json()["input_ranges"] == plan.input_ranges


def test_a_send_that_found_no_credit_is_not_overtaken_by_the_next_of_its_sender():
    """The executor's ready queue may hold a sender's microbatch-1 send ahead of its microbatch-0
    send (which found no credit and went to the tail); once the credit comes, microbatch 0 must
    still go first: the receiver takes the transfers as microbatches in arrival order."""
    from collections import deque
    from types import SimpleNamespace

    from rdmaflow.graph.executor import ComputeOp, Executor, SendOp

    class Sender:
        depth, seq, acked = 1, 1, 0  # transfer 1 unacknowledged: no credit for the next yet
        receiver_closed = False

        def __init__(self):
            self.sent = []

        def has_credit(self):
            return self.acked >= self.seq + 1 - self.depth

        def send(self, tensor, timeout=None):
            self.seq += 1
            self.sent.append(tensor)
            return SimpleNamespace(result=lambda timeout=None: None)

    sender, edge = Sender(), SimpleNamespace(name="e")
    sends = [SendOp(edge, sender, f"mb{m}", m, lambda op, fut: None) for m in (0, 1)]
    ex = Executor("stage 0", 5.0, lambda: None)
    queue: deque = deque()
    ex._run_one(ComputeOp("F", [], lambda inputs: sends), queue, [])  # posts mb0, then mb1
    assert not ex._run_one(queue.popleft(), queue, [])  # mb0: no credit, to the tail
    assert list(queue) == [sends[1], sends[0]]
    sender.acked = 1  # the credit arrives
    assert not ex._run_one(queue.popleft(), queue, [])  # mb1 waits behind mb0
    assert ex._run_one(queue.popleft(), queue, []) and sender.sent == ["mb0"]
    sender.acked = 2
    assert ex._run_one(queue.popleft(), queue, []) and sender.sent == ["mb0", "mb1"]


# -- one stage in this process: what a step does with the batch, and the arguments it refuses ----

class Head(torch.nn.Module):
    """One stage: a layer, and the model's input returned beside its output."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.a(x), x


@pytest.fixture
def one_rank(monkeypatch):
    """This process as the whole job: rank 0 of 1, serving the job's store itself."""
    from rdmaflow.bench.processes import free_port

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                 "RDMAFLOW_JOB_SECRET": "one-rank-job-secret-0123"}.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("rows", [17, 6])
def test_uneven_microbatches_give_the_whole_batchs_gradient(one_rank, rows):
    """A Dim on the batch lets 17 rows through 4 microbatches (5, 4, 4, 4): each microbatch's
    loss is weighted by its rows, so the gradient is that of the whole batch's mean loss (it
    was each divided by 4: off by up to 3e-2 here). Dim(min=1) takes 6 rows as 2, 2, 1, 1 (a
    1-row microbatch was refused as outside [2, 64]: the tracer's own ranges start at 2, not at
    the declared 1)."""
    torch.manual_seed(0)
    model, ref = Seq(), Seq()
    ref.load_state_dict(model.state_dict())
    pipe = graph.pipeline(model, (torch.randn(MB, 8),), dynamic_shapes=({0: Dim("b", min=1, max=64)},))
    assert pipe.plan(4).input_ranges[0] == [[1, 64], [8, 8]]
    x, y = torch.randn(rows, 8), torch.randn(rows, 4)
    with pipe.build_stage(timeout=20) as stage:
        graph.ScheduleGPipe(stage, 4, loss_fn=torch.nn.functional.mse_loss).step(x, target=y)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for name, p in stage.submod.named_parameters():
            torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad, rtol=1e-5, atol=1e-6)


def test_a_training_step_under_no_grad_trains(one_rank):
    """The forward runs with grad on whatever the caller's mode; the loss's share for backward
    was taken outside it, so a step under torch.no_grad() (an evaluation loop's context left
    around it) failed with autograd's "element 0 of tensors does not require grad"."""
    torch.manual_seed(0)
    model, ref = Seq(), Seq()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with graph.pipeline(model, (torch.randn(MB, 8),)).build_stage(timeout=20) as stage, torch.no_grad():
        graph.ScheduleGPipe(stage, 2, loss_fn=torch.nn.functional.mse_loss).step(x, target=y)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    for name, p in stage.submod.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad, rtol=1e-5, atol=1e-6)


def test_a_batch_the_microbatches_do_not_take_says_so(one_rank):
    """Without a Dim on the batch, each microbatch has the rows pipeline() captured: a batch of
    another size is refused naming the rows (it said only that microbatch 0 had the wrong shape)."""
    said = r"input 0 has 10 rows: 4 microbatches of the 4 rows pipeline\(\) captured take 16 \(a Dim on dimension 0"
    with graph.pipeline(Seq(), (torch.randn(MB, 8),)).build_stage(timeout=10) as stage, \
            pytest.raises(rdmaflow.InvalidArgumentError, match=said):
        graph.ScheduleGPipe(stage, 4).step(torch.randn(10, 8))


def test_inference_of_one_stage_returning_its_input_and_a_scalar(one_rank):
    """A one-stage model that returns its own input returns it (no edge from stage 0 to itself,
    on which nothing would ever be sent: that waited out the timeout); a scalar output comes
    back one element per microbatch (torch.cat of scalars raised RuntimeError)."""
    x = torch.randn(16, 8)
    head = Head()
    with graph.pipeline(head, (torch.randn(MB, 8),)).build_stage(timeout=10) as stage:
        y, back = graph.ScheduleGPipe(stage, 4).step(x)
        assert torch.equal(back, x)
        torch.testing.assert_close(y, head(x)[0].detach())

    class Total(Seq):
        def forward(self, x):
            return self.b(torch.relu(self.a(x))).sum()

    torch.manual_seed(1)
    m = Total()
    with graph.pipeline(m, (torch.randn(MB, 8),)).build_stage(timeout=10) as stage:
        out = graph.ScheduleGPipe(stage, 4).step(x)
        assert out.shape == (4,)
        torch.testing.assert_close(out, torch.stack([m(xm) for xm in x.tensor_split(4)]).detach())


class Offset(Seq):
    """Makes a tensor on its input's device: captured on the meta device, that call says meta."""

    def forward(self, x):
        return self.b(torch.relu(self.a(x) + torch.ones(x.shape[0], 16, device=x.device)))


def test_a_model_made_on_the_meta_device_runs_once_its_stage_has_memory(one_rank):
    """No rank need hold the whole model: it is made and captured on the meta device, and each
    stage gives its own part memory (to_empty, then its weights) before its first step. A step
    before that says so; a tensor the model makes on its input's device is made on the host."""
    with torch.device("meta"):
        model = Offset()
    pipe = graph.pipeline(model, (torch.randn(MB, 8, device="meta"),))
    devices = [a for st in pipe.stages for n in st.module.graph.nodes for a in (*n.args, *n.kwargs.values())
               if isinstance(a, torch.device)]
    assert devices and all(d.type == "cpu" for d in devices), devices
    x = torch.randn(16, 8)
    meta = r"stage 0's a\.weight, a\.bias, b\.weight \.\.\. are on the meta device"
    with pipe.build_stage(timeout=10) as stage, pytest.raises(rdmaflow.InvalidArgumentError, match=meta):
        graph.ScheduleGPipe(stage, 4).step(x)
    torch.manual_seed(2)
    ref = Offset()
    with graph.pipeline(model, (torch.randn(MB, 8, device="meta"),)).build_stage(timeout=10) as stage:
        stage.submod.to_empty(device="cpu")
        stage.submod.load_state_dict(ref.state_dict())
        torch.testing.assert_close(graph.ScheduleGPipe(stage, 4).step(x), ref(x).detach())


class Structured(Seq):
    """Returns a dict holding tuples, one of a reduction and one of a single tensor."""

    def forward(self, x):
        h = torch.relu(self.a(x))
        y = self.b(h)
        return {"y": y, "aux": (y.sum(), x * 2), "one": (h,)}


def test_outputs_keep_the_structure_the_model_returns(one_rank):
    """step() and loss_fn get the model's dict of tuples, not its tensors flattened into one
    tuple (they did: a user's loss_fn indexing out["y"] raised TypeError); a target may be a
    dict too, and uneven microbatches still weigh by their rows."""
    torch.manual_seed(2)
    x = torch.randn(16, 8)
    model = Structured()
    with graph.pipeline(model, (torch.randn(MB, 8),)).build_stage(timeout=20) as stage:
        out = graph.ScheduleGPipe(stage, 4).step(x)
    ref = model(x)
    assert set(out) == {"y", "aux", "one"} and isinstance(out["aux"], tuple) and isinstance(out["one"], tuple)
    torch.testing.assert_close(out["y"], ref["y"].detach())
    torch.testing.assert_close(out["aux"][0], torch.stack([model(xm)["aux"][0] for xm in x.tensor_split(4)]).detach())
    assert torch.equal(out["aux"][1], x * 2)
    torch.testing.assert_close(out["one"][0], ref["one"][0].detach())

    seen = []

    def loss_fn(o, t):  # a target of that kind too: a dict, cut into the microbatches tensor by tensor
        seen.append((sorted(o), sorted(t), t["y"].shape[0]))
        return torch.nn.functional.mse_loss(o["y"], t["y"]) + 0.5 * (o["aux"][1] * t["w"]).mean()

    y, w = torch.randn(17, 4), torch.randn(17, 8)
    x = torch.randn(17, 8)
    with graph.pipeline(model, (torch.randn(MB, 8),), dynamic_shapes=({0: Dim("b", max=64)},)).build_stage(
            timeout=20) as stage:
        graph.ScheduleGPipe(stage, 4, loss_fn=loss_fn).step(x, target={"y": y, "w": w})
        out = model(x)
        (torch.nn.functional.mse_loss(out["y"], y) + 0.5 * (out["aux"][1] * w).mean()).backward()
        for name, p in stage.submod.named_parameters():
            torch.testing.assert_close(p.grad, dict(model.named_parameters())[name].grad, rtol=1e-5, atol=1e-6)
    assert seen == [(["aux", "one", "y"], ["w", "y"], 5)] + [(["aux", "one", "y"], ["w", "y"], 4)] * 3


class Keywords(Seq):
    """Takes keyword inputs besides its positional one, as a masked model does."""

    def forward(self, x, mask=None, shift=None):
        return self.b(torch.relu(self.a(x) * mask + shift))


def test_keyword_inputs_are_captured_and_taken_by_step_in_any_order(one_rank):
    """pipeline(mb_kwargs=) captures keyword inputs and step() takes the batch's the same way
    (in any order, as Python does), each cut into the microbatches like a positional input."""
    torch.manual_seed(3)
    model = Keywords()
    x, mask, shift, y = torch.randn(16, 8), (torch.rand(16, 16) > 0.5).float(), torch.randn(16, 16), torch.randn(16, 4)
    pipe = graph.pipeline(model, (x[:4],), mb_kwargs={"shift": shift[:4], "mask": mask[:4]})
    with pipe.build_stage(timeout=20) as stage:
        out = graph.ScheduleGPipe(stage, 4).step(x, mask=mask, shift=shift)
        torch.testing.assert_close(out, model(x, mask=mask, shift=shift).detach())
    for bad, said in (((x,), r"got 1 positional and keywords \['mask'\]$"),
                      ((x, mask), r"got 2 positional and keywords \['mask'\]$")):
        with pipe.build_stage(timeout=20) as stage, pytest.raises(
                rdmaflow.InvalidArgumentError, match=r"stage 0 takes the model's inputs as pipeline\(\) captured "
                                                     r"them: 1 positional and keywords \['shift', 'mask'\], 3 tensors "
                                                     r"in all; " + said):
            graph.ScheduleGPipe(stage, 4).step(*bad, mask=mask)
    with pipe.build_stage(timeout=20) as stage:
        graph.ScheduleGPipe(stage, 4, loss_fn=torch.nn.functional.mse_loss).step(x, shift=shift, mask=mask, target=y)
        torch.nn.functional.mse_loss(model(x, mask=mask, shift=shift), y).backward()
        for name, p in stage.submod.named_parameters():
            torch.testing.assert_close(p.grad, dict(model.named_parameters())[name].grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(graph.CaptureError, match=r"keywords \['nope'\]\) do not fit Keywords.forward: got an "
                                                 r"unexpected keyword argument 'nope'"):
        graph.pipeline(model, (x[:4],), mb_kwargs={"nope": x[:4]})


def test_stage_and_schedule_arguments_are_refused_by_name(one_rank, monkeypatch):
    pipe = graph.pipeline(Seq(), (torch.randn(MB, 8),))
    for bad in (0, -3, 2.5, "4", None, True, float("nan")):
        with pytest.raises(rdmaflow.InvalidArgumentError, match="n_microbatches must be a positive integer"):
            pipe.plan(bad)
    with pytest.raises(rdmaflow.InvalidArgumentError, match="schedule must be one of"):
        pipe.plan(2, schedule="bogus")
    for bad in (float("nan"), float("inf"), -1, 0, "10", 1e300):
        with pytest.raises(rdmaflow.InvalidArgumentError, match="timeout must be a positive, finite number"):
            pipe.build_stage(timeout=bad)
    monkeypatch.setenv("RDMAFLOW_GRAPH_TIMEOUT", "abc")
    with pytest.raises(rdmaflow.InvalidArgumentError, match=r"\$RDMAFLOW_GRAPH_TIMEOUT must be a number of seconds"):
        pipe.build_stage()
    monkeypatch.delenv("RDMAFLOW_GRAPH_TIMEOUT")
    for bad in ("0", 1, True):
        with pytest.raises(rdmaflow.InvalidArgumentError, match="rank r runs stage r"):
            pipe.build_stage(bad)
    class Adjacent(Seq):
        def forward(self, x):
            h = self.a(x)
            graph.pipe_split()
            graph.pipe_split()
            return self.b(h)

    with pytest.raises(graph.CaptureError, match="stage 1 of 3 has no computation: two split points are adjacent"):
        graph.pipeline(Adjacent(), (torch.randn(MB, 8),))
    with pytest.raises(graph.CaptureError, match="it is a parameter or buffer"):
        graph.pipeline(type("Weight", (Seq,), {"forward": lambda self, x: (self.a(x), self.a.weight)})(), (torch.randn(MB, 8),))

    class WeightOfStage0(Seq):  # returned from the last stage: it was called tied weights
        def forward(self, x):
            h = self.a(x)
            graph.pipe_split()
            return self.b(h), self.a.weight

    with pytest.raises(graph.CaptureError, match=r"model output 'a.weight' is not a tensor computed by a stage "
                                                 r"\(it is a parameter or buffer"):
        graph.pipeline(WeightOfStage0(), (torch.randn(MB, 8),))

    stage = pipe.build_stage(0, timeout=20)
    for bad in (2.5, "4", None):
        with pytest.raises(rdmaflow.InvalidArgumentError, match="n_microbatches must be a positive integer"):
            graph.ScheduleGPipe(stage, bad)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    sched = graph.ScheduleGPipe(stage, 2, loss_fn=lambda out, t: torch.nn.functional.mse_loss(out, t).detach())
    with pytest.raises(rdmaflow.InvalidArgumentError, match="losses= takes a list"):
        sched.step(x, target=y, losses=())
    with pytest.raises(rdmaflow.InvalidArgumentError, match="does not require grad"):
        sched.step(x, target=y)
    for rows in (6, 16):  # cut 3 + 3 or 8 + 8 against the inputs' 4 + 4
        with pytest.raises(rdmaflow.InvalidArgumentError,
                           match=rf"the target has {rows} rows; the batch has 8 \(2 microbatches of the 4 rows"):
            sched.step(x, target=torch.randn(rows, 4))
    with pytest.raises(rdmaflow.InvalidArgumentError, match="the target's tensor 1 has 6 rows"):
        sched.step(x, target=(y, torch.zeros(6)))
    stage.close()
    with pytest.raises(rdmaflow.InvalidArgumentError, match="stage 0 is closed"):
        sched.step(x, target=y)

    with pipe.build_stage(timeout=20) as stage:  # a loss of shape [1] is the scalar it holds
        losses = []
        graph.ScheduleGPipe(stage, 2, loss_fn=lambda out, t: ((out - t) ** 2).mean().reshape(1)).step(
            x, target=y, losses=losses)
        assert [v.shape for v in losses] == [(), ()]
