"""A plain PyTorch MoCo v2 train step: the reference ``train_step.py --compare_torch`` times
jssl's step against, with the same shapes.

The ResNet is written here in plain ``torch.nn`` (torchvision is not a dependency) with the
layout of jssl/models/resnet.py, i.e. torchvision's ``resnet.py`` v1.5: BasicBlock for
ResNet-18/34, Bottleneck (stride in the 3x3) for ResNet-50+, 1x1-conv + BN projection
shortcuts, optional CIFAR stem (3x3 stride-1 conv1, no max-pool), zero-initialised last BN of
each block (MoCo v2's ``zero_init_residual``). The head is VISSL's MLP (Linear-ReLU-Linear, no
BN), the loss MoCo's InfoNCE against a queue of L2-normalised keys (He et al. 2020, Alg. 1),
the key encoder runs on a shuffled batch (shuffle-BN on one device is a permutation) and
follows the query encoder by EMA, and the optimizer is SGD with Nesterov momentum 0.9 and
weight decay 1e-4 on every parameter (VISSL's MoCo recipe, regularize_bn True), as jssl's
configs/moco.py. bfloat16 runs the forward passes under ``torch.autocast`` (bf16 convolutions
and matmuls, float32 parameters, optimizer state and loss), PyTorch's mixed-precision path.
The step runs on the GPU when PyTorch sees one (CUDA), else on the CPU; ``compile=True`` wraps
both encoders in ``torch.compile`` (``train_step.py --compare_torch --torch_compile``).
Activations are channels-last (NHWC, as jssl's, and the faster layout of oneDNN and of cuDNN's
bf16 convolutions) unless ``channels_last=False`` asks for PyTorch's default NCHW
(``train_step.py --compare_torch --torch_layout=nchw`` times that one).

Importing this module imports torch, a development dependency only.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# depth -> (block kind, blocks per stage), as torchvision's resnet18..resnet152.
ARCHS = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
}


def _conv(cin: int, cout: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride, padding=k // 2, bias=False)


class Block(nn.Module):
    """BasicBlock (two 3x3) or Bottleneck (1x1, strided 3x3, 1x1 x4) with its shortcut."""

    def __init__(self, kind: str, cin: int, planes: int, stride: int):
        super().__init__()
        cout = planes * (4 if kind == "bottleneck" else 1)
        if kind == "basic":
            convs = [_conv(cin, planes, 3, stride), _conv(planes, planes, 3)]
        else:
            convs = [
                _conv(cin, planes, 1),
                _conv(planes, planes, 3, stride),
                _conv(planes, cout, 1),
            ]
        self.convs = nn.ModuleList(convs)
        self.bns = nn.ModuleList(nn.BatchNorm2d(c.out_channels) for c in convs)
        nn.init.zeros_(self.bns[-1].weight)  # zero_init_residual (Goyal et al. 2017)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns, strict=True)):
            out = bn(conv(out))
            if i < len(self.convs) - 1:
                out = F.relu(out)
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class Encoder(nn.Module):
    """ResNet trunk (global average pool) and the MoCo v2 MLP head."""

    def __init__(self, depth: int, cifar_stem: bool, head_dims: tuple[int, ...]):
        super().__init__()
        kind, blocks = ARCHS[depth]
        if cifar_stem:
            stem = [_conv(3, 64, 3), nn.BatchNorm2d(64), nn.ReLU()]
        else:
            stem = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
            stem.append(nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for stage, n in enumerate(blocks):
            planes = 64 * 2**stage
            for b in range(n):
                layers.append(Block(kind, cin, planes, 2 if stage > 0 and b == 0 else 1))
                cin = layers[-1].convs[-1].out_channels
        self.trunk = nn.Sequential(*stem, *layers)
        head: list[nn.Module] = []
        for i, (fan_in, dim) in enumerate(zip(head_dims[:-1], head_dims[1:], strict=True)):
            head += [nn.Linear(fan_in, dim)] + ([nn.ReLU()] if i < len(head_dims) - 2 else [])
        self.head = nn.Sequential(*head)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):  # torchvision: kaiming_normal_, fan_out, relu
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x).mean(dim=(2, 3)))


class MoCoStep:
    """One MoCo v2 step on fixed inputs: query/key encoders, queue, SGD nesterov."""

    def __init__(
        self,
        spec: dict[str, Any],
        dtype: str,
        queue_size: int,
        seed: int = 0,
        channels_last: bool = True,
        compile: bool = False,
    ):
        torch.manual_seed(seed)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        head_dims = (spec["head"], 2048, 128)
        self.query_encoder = Encoder(int(spec["trunk"][6:]), spec["cifar_stem"], head_dims)
        self.key_encoder = Encoder(int(spec["trunk"][6:]), spec["cifar_stem"], head_dims)
        self.key_encoder.load_state_dict(self.query_encoder.state_dict())
        for p in self.key_encoder.parameters():
            p.requires_grad_(False)
        self.query_encoder.to(self.device)
        self.key_encoder.to(self.device)
        self.queue = F.normalize(torch.randn(queue_size, head_dims[-1]), dim=1).to(self.device)
        self.ptr = 0
        self.momentum, self.temperature = 0.999, 0.2  # configs/moco.py
        self.optimizer = torch.optim.SGD(
            self.query_encoder.parameters(),
            lr=0.03 * spec["batch"] / 256,
            momentum=0.9,
            nesterov=True,
            weight_decay=1e-4,
        )
        self.autocast = dtype == "bfloat16"
        n, size = spec["batch"], spec["image_size"]
        self.views = torch.randn(2, n, 3, size, size).to(self.device)
        if channels_last:  # NHWC activations, as jssl's: oneDNN's NHWC kernels
            for module in (self.query_encoder, self.key_encoder):
                module.to(memory_format=torch.channels_last)
            self.views = tuple(v.contiguous(memory_format=torch.channels_last) for v in self.views)
        self.query, self.key = self.query_encoder, self.key_encoder
        if compile:
            self.query, self.key = torch.compile(self.query), torch.compile(self.key)

    def __call__(self) -> float:
        view_q, view_k = self.views
        n = view_q.shape[0]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            query = self.query(view_q)
            with torch.no_grad():
                perm = torch.randperm(n, device=self.device)
                keys = self.key(view_k[perm])[torch.argsort(perm)]
        query = F.normalize(query.float(), dim=1)
        keys = F.normalize(keys.float(), dim=1)
        logits = torch.cat([(query * keys).sum(1, keepdim=True), query @ self.queue.T], dim=1)
        labels = torch.zeros(n, dtype=torch.long, device=self.device)
        loss = F.cross_entropy(logits / self.temperature, labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            key_params = list(self.key_encoder.parameters())
            torch._foreach_mul_(key_params, self.momentum)
            torch._foreach_add_(
                key_params, list(self.query_encoder.parameters()), alpha=1 - self.momentum
            )
            self.queue[self.ptr : self.ptr + n] = keys
            self.ptr = (self.ptr + n) % self.queue.shape[0]
        return float(loss)


def run_case(
    spec: dict[str, Any],
    dtype: str,
    steps: int,
    queue_size: int,
    channels_last: bool = True,
    compile: bool = False,
) -> dict[str, Any]:
    """Times ``steps`` MoCo steps after two warm-up ones; returns the per-step seconds (each
    step ends by reading the loss, which waits for the GPU)."""
    step = MoCoStep(spec, dtype, queue_size, channels_last=channels_last, compile=compile)
    t0 = time.perf_counter()
    step()  # warm-up: oneDNN primitive creation or cuDNN's algorithm choice, allocator, compile
    first_s = time.perf_counter() - t0
    step()
    times, cpu_times = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return dict(
        step_s=times,
        cpu_s=cpu_times,
        first_s=first_s,
        loss=loss,
        threads=torch.get_num_threads(),
        device=str(step.device),
        device_peak_gib=(
            torch.cuda.max_memory_allocated() / 2**30 if step.device.type == "cuda" else None
        ),
    )
