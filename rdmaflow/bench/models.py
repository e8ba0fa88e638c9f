"""The six benchmark models of Xue et al. §5.2, Table 2, in plain PyTorch (no torchvision).

Table 2 lists each benchmark's "model size (MB)", the sum of the sizes of its variable tensors,
and its number of variable tensors. The sizes are float32 bytes / 2**20 (MiB), not / 1e6: with
MiB every row is matched to the last printed digit by a standard configuration (below), while
1e6 fits none of them (LSTM and GRU would need an input width of 930.6). The configurations
are pinned down by the sizes themselves; those of the TF-slim nets (alexnet_v2, vgg_16,
inception_v3) and a 10-class synthetic label set fit exactly:

============ ============================================ ============== ========= ============
name         configuration (input -> output)              params         MiB here  Table 2
============ ============================================ ============== ========= ============
alexnet      TF-slim alexnet_v2: 3x224x224 -> 10 classes  46,247,882     176.42    176.42 (16)
             conv 64/11s4 VALID, 192/5, 384/3, 384/3,
             256/3 (3x3/2 max pools -> 256x5x5), fc 4096,
             4096, 10; 16 tensors
inception3   TF-slim inception_v3 with its auxiliary      24,353,332     92.90     92.90 (196)
             head: 3x299x299 -> 10 classes; convs
             without bias, batch norm with beta only
             (slim's scale=False), eps 1e-3; 196 tensors
vgg16        TF-slim vgg_16: 3x224x224 -> 10 classes;     134,301,514    512.32    512.32 (32)
             13 convs 3x3, fc 4096, 4096, 10; 32 tensors
lstm         one nn.LSTM layer, input 1024, hidden 1024,  9,421,800      35.94     35.93 (14)
             80 steps, then a 1024 -> 1000 classifier at
             every step; 6 tensors
gru          one nn.GRU layer, input 1024, hidden 1024,   7,322,600      27.93     27.92 (11)
             80 steps, then 1024 -> 1000 at every step;
             6 tensors
fcn5         five fully connected layers 784 -> 4096 ->   53,600,266     204.47    204.47 (10)
             4096 -> 4096 -> 4096 -> 10 (the "3 hidden
             layers of 4096" between the input and output
             layers), sigmoid activations; 10 tensors
============ ============================================ ============== ========= ============

Why these choices:

* 10 classes for the CNNs and FCN-5: with 1000 classes AlexNet/VGG-16/Inception-v3 would be
  191.9/527.8/103.6 MiB; with 10 they are 176.42/512.32/92.90, exactly Table 2. FCN-5 is the
  MNIST-shaped DLBench FCN-5 (784 inputs, 10 outputs) with 4096-wide layers.
* LSTM/GRU: Table 2 fixes hidden 1024 and 80 steps. The difference LSTM - GRU (one gate block
  of (input + 1024) x 1024 + 1024) gives an input width of 1024, and the remainder a
  1024 -> 1000 output layer: a dense 1024-wide input per step (no embedding table) and 1000
  classes (a language model over a 1000-word vocabulary) predicted at every step. TensorFlow
  kept one bias per gate and separate per-gate matrices (hence 14 and 11 tensors); nn.LSTM /
  nn.GRU keep two biases per gate in four tensors, +16 KB / +12 KB, 0.04 % over Table 2.
* Inception-v3: the auxiliary head is part of the model (it is in Table 2's 196 tensors:
  94 conv+beta pairs, the logits, the aux conv pairs and aux logits). In training mode the
  model runs it after Mixed_6e, where it is registered, and returns ``(N, 2, classes)``: main
  and auxiliary logits stacked; ``loss_fn("inception3")`` is CE(main) + 0.4 CE(aux), slim's
  weighting. In eval mode the head is skipped and the output is ``(N, classes)``. Its batch
  norm running statistics (running_mean/var/num_batches_tracked) are buffers, not parameters:
  they are not part of Table 2's model size and are not exchanged with a parameter server.

Parameter order: every parameter-owning module is a leaf module called exactly once per forward
(once per forward in training mode for the Inception aux head), and modules are registered in
the order they run, so ``named_parameters()`` order is forward order and forward pre-hooks fire
in that order (the parameter server pipelines weight delivery by it). Activations and dropout
are never in-place.

Synthetic data (§5.2: "generated on the fly") comes from torch.randn/torch.randint with the
caller's generator, on that generator's device. ``mlp-tiny`` (32 -> 64 -> 10, 2,762 params)
is an extra model for harness tests, accepted everywhere but not in MODELS.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MODELS",
    "TABLE2_MB",
    "TABLE2_TENSORS",
    "TEST_MODELS",
    "build",
    "describe",
    "loss_fn",
    "param_bytes",
    "synthetic_batch",
]

MiB = 1 << 20

# Xue et al. (EuroSys '19), Table 2: model size in MB (= MiB, see the module docstring) and variable tensor count.
TABLE2_MB: dict[str, float] = {
    "alexnet": 176.42, "inception3": 92.90, "vgg16": 512.32,
    "lstm": 35.93, "gru": 27.92, "fcn5": 204.47,
}
TABLE2_TENSORS: dict[str, int] = {
    "alexnet": 16, "inception3": 196, "vgg16": 32, "lstm": 14, "gru": 11, "fcn5": 10,
}
MODELS: tuple[str, ...] = ("alexnet", "inception3", "vgg16", "lstm", "gru", "fcn5")
TEST_MODELS: tuple[str, ...] = ("mlp-tiny",)

CNN_CLASSES = 10
RNN_STEPS = 80
RNN_HIDDEN = 1024
RNN_INPUT = 1024
RNN_CLASSES = 1000
FCN5_IN, FCN5_HIDDEN, FCN5_OUT = 784, 4096, 10
TINY_IN, TINY_HIDDEN, TINY_OUT = 32, 64, 10
INCEPTION_AUX_WEIGHT = 0.4

# Per-sample input shape (no batch dimension); inputs are float32, targets int64 class indices.
_INPUT_SHAPE: dict[str, tuple[int, ...]] = {
    "alexnet": (3, 224, 224),
    "inception3": (3, 299, 299),
    "vgg16": (3, 224, 224),
    "lstm": (RNN_STEPS, RNN_INPUT),
    "gru": (RNN_STEPS, RNN_INPUT),
    "fcn5": (FCN5_IN,),
    "mlp-tiny": (TINY_IN,),
}
# Per-sample target shape and number of classes.
_TARGET_SHAPE: dict[str, tuple[int, ...]] = {
    "lstm": (RNN_STEPS,), "gru": (RNN_STEPS,),
}
_CLASSES: dict[str, int] = {
    "alexnet": CNN_CLASSES, "inception3": CNN_CLASSES, "vgg16": CNN_CLASSES,
    "lstm": RNN_CLASSES, "gru": RNN_CLASSES, "fcn5": FCN5_OUT, "mlp-tiny": TINY_OUT,
}


# --------------------------------------------------------------------------- AlexNet, VGG-16


class SlimClassifier(nn.Module):
    """The fully connected head TF-slim's alexnet_v2 and vgg_16 share: fc6 and fc7 of 4096 units
    with ReLU and dropout, then fc8 to the classes."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.fc6 = nn.Linear(in_features, 4096)
        self.drop6 = nn.Dropout(0.5)
        self.fc7 = nn.Linear(4096, 4096)
        self.drop7 = nn.Dropout(0.5)
        self.fc8 = nn.Linear(4096, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop6(F.relu(self.fc6(torch.flatten(x, 1))))
        x = self.drop7(F.relu(self.fc7(x)))
        return self.fc8(x)


class AlexNet(nn.Module):
    """TF-slim alexnet_v2 at 224x224: conv1 VALID stride 4, other convs SAME, 3x3/2 max pools."""

    def __init__(self, num_classes: int = CNN_CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 11, stride=4)               # 224 -> 54, pool -> 26
        self.conv2 = nn.Conv2d(64, 192, 5, padding=2)             # 26, pool -> 12
        self.conv3 = nn.Conv2d(192, 384, 3, padding=1)
        self.conv4 = nn.Conv2d(384, 384, 3, padding=1)
        self.conv5 = nn.Conv2d(384, 256, 3, padding=1)            # 12, pool -> 5
        self.head = SlimClassifier(256 * 5 * 5, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 3, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 3, 2)
        x = F.relu(self.conv3(x))
        x = F.relu(self.conv4(x))
        x = F.max_pool2d(F.relu(self.conv5(x)), 3, 2)
        return self.head(x)


_VGG16_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    """TF-slim vgg_16 (configuration D) at 224x224: 13 3x3 convs, five 2x2 max pools, 3 fc."""

    def __init__(self, num_classes: int = CNN_CLASSES):
        super().__init__()
        self.convs = nn.ModuleList()
        self._pool_after: list[bool] = []
        cin = 3
        for v in _VGG16_CFG:
            if v == "M":
                self._pool_after[-1] = True
                continue
            self.convs.append(nn.Conv2d(cin, v, 3, padding=1))
            self._pool_after.append(False)
            cin = v
        self.head = SlimClassifier(512 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, pool in zip(self.convs, self._pool_after):
            x = F.relu(conv(x))
            if pool:
                x = F.max_pool2d(x, 2, 2)
        return self.head(x)


# --------------------------------------------------------------------------- Inception-v3


class BatchNormBeta(nn.BatchNorm2d):
    """Batch norm with a learned shift only (TF-slim's batch_norm default, scale=False).

    A leaf module: one parameter, ``bias`` (beta); ``weight`` is None. Running statistics are
    buffers, as in nn.BatchNorm2d.
    """

    def __init__(self, num_features: int, eps: float = 1e-3, momentum: float = 0.1):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=False)
        self.bias = nn.Parameter(torch.zeros(num_features))


class ConvBN(nn.Module):
    """conv (no bias) -> batch norm (beta only) -> ReLU."""

    def __init__(self, cin: int, cout: int, kernel_size, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=padding, bias=False)
        self.bn = BatchNormBeta(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    def __init__(self, cin: int, pool_features: int):
        super().__init__()
        self.branch1x1 = ConvBN(cin, 64, 1)
        self.branch5x5_1 = ConvBN(cin, 48, 1)
        self.branch5x5_2 = ConvBN(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = ConvBN(cin, 64, 1)
        self.branch3x3dbl_2 = ConvBN(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = ConvBN(96, 96, 3, padding=1)
        self.branch_pool = ConvBN(cin, pool_features, 1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3 = ConvBN(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = ConvBN(cin, 64, 1)
        self.branch3x3dbl_2 = ConvBN(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = ConvBN(96, 96, 3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([b3, bd, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    def __init__(self, cin: int, c7: int):
        super().__init__()
        self.branch1x1 = ConvBN(cin, 192, 1)
        self.branch7x7_1 = ConvBN(cin, c7, 1)
        self.branch7x7_2 = ConvBN(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = ConvBN(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = ConvBN(cin, c7, 1)
        self.branch7x7dbl_2 = ConvBN(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = ConvBN(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = ConvBN(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = ConvBN(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = ConvBN(cin, 192, 1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = self.branch7x7dbl_1(x)
        bd = self.branch7x7dbl_3(self.branch7x7dbl_2(bd))
        bd = self.branch7x7dbl_5(self.branch7x7dbl_4(bd))
        bp = self.branch_pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([b1, b7, bd, bp], 1)


class InceptionD(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3_1 = ConvBN(cin, 192, 1)
        self.branch3x3_2 = ConvBN(192, 320, 3, stride=2)
        self.branch7x7x3_1 = ConvBN(cin, 192, 1)
        self.branch7x7x3_2 = ConvBN(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = ConvBN(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = ConvBN(192, 192, 3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_2(self.branch7x7x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(b7))
        return torch.cat([b3, b7, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.branch1x1 = ConvBN(cin, 320, 1)
        self.branch3x3_1 = ConvBN(cin, 384, 1)
        self.branch3x3_2a = ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = ConvBN(cin, 448, 1)
        self.branch3x3dbl_2 = ConvBN(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = ConvBN(cin, 192, 1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        bp = self.branch_pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([b1, b3, bd, bp], 1)


class InceptionAux(nn.Module):
    """slim's AuxLogits: 5x5/3 avg pool, 1x1 conv 128, 5x5 conv 768, logits."""

    def __init__(self, cin: int, num_classes: int):
        super().__init__()
        self.conv0 = ConvBN(cin, 128, 1)
        self.conv1 = ConvBN(128, 768, 5)
        self.fc = nn.Linear(768, num_classes)

    def forward(self, x):
        x = F.avg_pool2d(x, 5, stride=3)                          # 17 -> 5
        x = self.conv1(self.conv0(x))                             # 5 -> 1
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class InceptionV3(nn.Module):
    """TF-slim inception_v3 at 299x299 with its auxiliary head (see the module docstring)."""

    def __init__(self, num_classes: int = CNN_CLASSES):
        super().__init__()
        self.Conv2d_1a_3x3 = ConvBN(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = ConvBN(32, 32, 3)
        self.Conv2d_2b_3x3 = ConvBN(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = ConvBN(64, 80, 1)
        self.Conv2d_4a_3x3 = ConvBN(80, 192, 3)
        self.Mixed_5b = InceptionA(192, 32)
        self.Mixed_5c = InceptionA(256, 64)
        self.Mixed_5d = InceptionA(288, 64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, 128)
        self.Mixed_6c = InceptionC(768, 160)
        self.Mixed_6d = InceptionC(768, 160)
        self.Mixed_6e = InceptionC(768, 192)
        self.AuxLogits = InceptionAux(768, num_classes)           # runs here, in training mode
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280)
        self.Mixed_7c = InceptionE(2048)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, 3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, 3, stride=2)
        x = self.Mixed_5d(self.Mixed_5c(self.Mixed_5b(x)))
        x = self.Mixed_6a(x)
        x = self.Mixed_6e(self.Mixed_6d(self.Mixed_6c(self.Mixed_6b(x))))
        aux = self.AuxLogits(x) if self.training else None
        x = self.Mixed_7c(self.Mixed_7b(self.Mixed_7a(x)))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        logits = self.fc(self.dropout(x))
        if aux is None:
            return logits
        return torch.stack([logits, aux], 1)                      # (N, 2, classes)


# --------------------------------------------------------------------------- RNNs, FCN, MLP


class RNNClassifier(nn.Module):
    """One recurrent layer over all steps (batch first), then a classifier at every step."""

    def __init__(self, cell: str, input_size: int = RNN_INPUT, hidden: int = RNN_HIDDEN,
                 num_classes: int = RNN_CLASSES):
        super().__init__()
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.rnn = rnn(input_size, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, T, input) -> (N, T, classes)
        out, _ = self.rnn(x)
        return self.fc(out)


class MLP(nn.Module):
    """Fully connected layers; ``act`` between them, none after the last."""

    def __init__(self, dims: tuple[int, ...], act: type[nn.Module] = nn.ReLU):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.act(x)
        return x


# --------------------------------------------------------------------------- API

_ALL = MODELS + TEST_MODELS

_CONSTRUCTORS: dict[str, Callable[[], nn.Module]] = {
    "alexnet": AlexNet,
    "inception3": InceptionV3,
    "vgg16": VGG16,
    "lstm": lambda: RNNClassifier("lstm"),
    "gru": lambda: RNNClassifier("gru"),
    "fcn5": lambda: MLP((FCN5_IN,) + (FCN5_HIDDEN,) * 4 + (FCN5_OUT,), act=nn.Sigmoid),
    "mlp-tiny": lambda: MLP((TINY_IN, TINY_HIDDEN, TINY_OUT)),
}


def _check(name: str) -> str:
    if name not in _CONSTRUCTORS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(_ALL)}")
    return name


def build(name: str, seed: int = 0) -> nn.Module:
    """Construct model ``name`` with a deterministic initialization from ``seed``.

    PyTorch's default initializers draw from the CPU generator, seeded here inside
    torch.random.fork_rng so the caller's random state is left as it was. Parameters are made
    on the current default device (e.g. under ``with torch.device("meta")``); the result is in
    training mode.
    """
    _check(name)
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        model = _CONSTRUCTORS[name]()
    return model.train()


@functools.cache
def _meta_stats(name: str) -> tuple[int, int, int]:
    """(bytes, elements, tensors) of the parameters, from a model built on the meta device."""
    with torch.device("meta"):
        model = _CONSTRUCTORS[name]()
    params = list(model.parameters())
    return (sum(p.numel() * p.element_size() for p in params),
            sum(p.numel() for p in params), len(params))


def param_bytes(name: str) -> int:
    """Sum of the parameters' sizes in bytes, counted on the meta device (nothing allocated)."""
    return _meta_stats(_check(name))[0]


def synthetic_batch(name: str, batch: int,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for one mini-batch, drawn on the fly on ``generator``'s device.

    inputs: float32 standard normal of shape (batch, *input_shape); targets: int64 class
    indices of shape (batch,), or (batch, 80) for lstm/gru (one label per step).
    """
    _check(name)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    dev = generator.device
    x = torch.randn((batch,) + _INPUT_SHAPE[name], generator=generator, device=dev)
    y = torch.randint(0, _CLASSES[name], (batch,) + _TARGET_SHAPE.get(name, ()),
                      generator=generator, device=dev)
    return x, y


def _cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


def _sequence_cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # (N, T, C) logits, (N, T) labels: the mean over all N*T steps.
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _inception_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:  # training mode: (N, 2, C) main and auxiliary logits
        return (F.cross_entropy(out[:, 0], target)
                + INCEPTION_AUX_WEIGHT * F.cross_entropy(out[:, 1], target))
    return F.cross_entropy(out, target)


def loss_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss of model ``name``: loss(model(inputs), targets) -> scalar."""
    _check(name)
    if name in ("lstm", "gru"):
        return _sequence_cross_entropy
    if name == "inception3":
        return _inception_loss
    return _cross_entropy


def describe(name: str) -> dict:
    """Facts for docs and tables.

    Keys: name, params (parameter count), mb (parameter bytes / 2**20), table2_mb (None for
    test models), input_shape (per sample), plus target_shape, classes, tensors (parameter
    tensor count) and table2_tensors.
    """
    _check(name)
    nbytes, nparams, ntensors = _meta_stats(name)
    return {
        "name": name,
        "params": nparams,
        "mb": nbytes / MiB,
        "table2_mb": TABLE2_MB.get(name),
        "input_shape": _INPUT_SHAPE[name],
        "target_shape": _TARGET_SHAPE.get(name, ()),
        "classes": _CLASSES[name],
        "tensors": ntensors,
        "table2_tensors": TABLE2_TENSORS.get(name),
    }
