"""The Table 2 benchmark models (rdmaflow.bench.models).

The big models are only built on the meta device (shapes, hooks and autograd without compute
or memory); real forward/backward runs on the small ones.
"""
from __future__ import annotations

import pytest
import torch

from rdmaflow.bench import models as M

ALL = M.MODELS + M.TEST_MODELS
MiB = 1 << 20


def _meta_batch(name: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = M.describe(name)
    x = torch.empty((batch,) + tuple(shape["input_shape"]), device="meta")
    y = torch.empty((batch,) + tuple(shape["target_shape"]), dtype=torch.long, device="meta")
    return x, y


def _output_shape(name: str, batch: int, training: bool = True) -> tuple[int, ...]:
    c = M.describe(name)["classes"]
    if name in ("lstm", "gru"):
        return (batch, 80, c)
    if name == "inception3" and training:
        return (batch, 2, c)
    return (batch, c)


def test_api_constants():
    assert M.MODELS == ("alexnet", "inception3", "vgg16", "lstm", "gru", "fcn5")
    assert M.TEST_MODELS == ("mlp-tiny",)
    assert M.TABLE2_MB == {"alexnet": 176.42, "inception3": 92.90, "vgg16": 512.32,
                           "lstm": 35.93, "gru": 27.92, "fcn5": 204.47}
    assert not set(M.MODELS) & set(M.TEST_MODELS)


@pytest.mark.parametrize("name", M.MODELS)
def test_param_bytes_match_table2(name):
    nbytes = M.param_bytes(name)
    mb = nbytes / MiB  # Table 2's MB is MiB (see the module docstring)
    assert abs(mb - M.TABLE2_MB[name]) / M.TABLE2_MB[name] < 0.05, (name, mb)
    # The configurations reproduce Table 2 to its printed precision (the RNNs within 0.1 %:
    # nn.LSTM/nn.GRU keep two bias vectors where TensorFlow kept one).
    assert abs(mb - M.TABLE2_MB[name]) / M.TABLE2_MB[name] < 1e-3, (name, mb)


def test_param_bytes_small_model():
    # mlp-tiny: 32 -> 64 -> 10, float32
    assert M.param_bytes("mlp-tiny") == 4 * (32 * 64 + 64 + 64 * 10 + 10)
    assert M.param_bytes("mlp-tiny") < 64 * 1024


@pytest.mark.parametrize("name", ALL)
def test_describe(name):
    d = M.describe(name)
    assert {"name", "params", "mb", "table2_mb", "input_shape"} <= set(d)
    assert d["name"] == name
    assert d["params"] * 4 == M.param_bytes(name)
    assert d["mb"] == pytest.approx(M.param_bytes(name) / MiB)
    assert d["table2_mb"] == M.TABLE2_MB.get(name)
    assert all(isinstance(s, int) and s > 0 for s in d["input_shape"])


@pytest.mark.parametrize("name", M.MODELS)
def test_tensor_counts(name):
    d = M.describe(name)
    if name in ("lstm", "gru"):
        assert d["tensors"] == 6  # nn.LSTM/nn.GRU: 4 tensors, classifier: 2
    else:
        assert d["tensors"] == d["table2_tensors"]


@pytest.mark.parametrize("name", ALL)
def test_forward_order_and_gradients_on_meta(name):
    """Every parameter-owning module runs once, in named_parameters() order, and every
    parameter gets exactly one accumulated gradient (checked on the meta device)."""
    with torch.device("meta"):
        model = M.build(name)
    assert model.training
    params = list(model.parameters())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)

    calls: list[torch.nn.Module] = []
    owners = [m for m in model.modules() if list(m.parameters(recurse=False))]
    for m in owners:
        m.register_forward_pre_hook(lambda mod, args: calls.append(mod))
    accumulated: list[torch.nn.Parameter] = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: accumulated.append(p))

    x, y = _meta_batch(name, 2)
    out = model(x)
    assert tuple(out.shape) == _output_shape(name, 2)
    assert len(calls) == len(owners) and len(set(map(id, calls))) == len(owners)
    in_call_order = [p for m in calls for p in m.parameters(recurse=False)]
    assert [id(p) for p in in_call_order] == [id(p) for p in params]

    loss = M.loss_fn(name)(out, y)
    assert loss.dim() == 0
    loss.backward()
    assert all(p.grad is not None for p in params)
    assert sorted(map(id, accumulated)) == sorted(map(id, params))


def test_inception_eval_skips_aux_head():
    with torch.device("meta"):
        model = M.build("inception3").eval()
    x, y = _meta_batch("inception3", 2)
    out = model(x)
    assert tuple(out.shape) == (2, 10)
    assert M.loss_fn("inception3")(out, y).dim() == 0


@pytest.mark.parametrize("name", ["mlp-tiny", "gru"])
def test_build_deterministic(name):
    a, b, c = M.build(name, seed=1), M.build(name, seed=1), M.build(name, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expect = torch.rand(3)
    torch.manual_seed(123)
    M.build("mlp-tiny", seed=7)
    assert torch.equal(torch.rand(3), expect)


@pytest.mark.parametrize("name", ALL)
def test_synthetic_batch_shapes(name):
    d = M.describe(name)
    g = torch.Generator().manual_seed(0)
    if name in ("alexnet", "vgg16", "inception3"):
        batch = 1  # keep the big images small in memory
    else:
        batch = 3
    x, y = M.synthetic_batch(name, batch, g)
    assert x.dtype == torch.float32 and tuple(x.shape) == (batch,) + tuple(d["input_shape"])
    assert y.dtype == torch.int64 and tuple(y.shape) == (batch,) + tuple(d["target_shape"])
    assert int(y.min()) >= 0 and int(y.max()) < d["classes"]
    x2, y2 = M.synthetic_batch(name, batch, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and torch.equal(y, y2)


@pytest.mark.parametrize("name", ["mlp-tiny", "fcn5", "lstm", "gru"])
def test_train_step_real(name):
    model = M.build(name, seed=0)
    x, y = M.synthetic_batch(name, 2, torch.Generator().manual_seed(1))
    out = model(x)
    assert tuple(out.shape) == _output_shape(name, 2)
    loss = M.loss_fn(name)(out, y)
    assert torch.isfinite(loss)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, n
        assert torch.isfinite(p.grad).all(), n


def test_unknown_name_raises():
    for fn in (M.build, M.param_bytes, M.loss_fn, M.describe):
        with pytest.raises(ValueError, match="alexnet"):
            fn("resnet50")
    with pytest.raises(ValueError, match="mlp-tiny"):
        M.synthetic_batch("nope", 1, torch.Generator())


@pytest.mark.parametrize("batch", [0, -1, 1.5, True])
def test_bad_batch_raises(batch):
    with pytest.raises(ValueError):
        M.synthetic_batch("mlp-tiny", batch, torch.Generator())
