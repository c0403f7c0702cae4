"""A torchvision-layout RegNetY in plain torch.nn, for the tests of RegNet weight import.

Module names, block structure and state-dict keys follow ``torchvision/models/regnet.py``
(``SimpleStemIN``, ``AnyStage``, ``ResBottleneckBlock``, ``BottleneckTransform`` with
``torchvision.ops.SqueezeExcitation``): ``stem.0``/``stem.1``, ``trunk_output.block{s}.
block{s}-{i}`` with ``proj.0``/``proj.1`` and ``f.a``, ``f.b``, ``f.se.fc1``/``fc2``, ``f.c``,
then ``fc``. torchvision itself is not a dependency (it would pin another torch). The stage
widths are given (``jssl.models.regnet.stages`` computes them from a RegNet design).
"""

from collections import OrderedDict

import torch

nn = torch.nn


class ConvBN(nn.Sequential):
    """Conv, BN and optionally ReLU as indices 0, 1, 2 (torchvision's Conv2dNormActivation)."""

    def __init__(self, width_in, width_out, kernel, stride=1, groups=1, relu=True):
        layers = [
            nn.Conv2d(width_in, width_out, kernel, stride, kernel // 2, groups=groups, bias=False),
            nn.BatchNorm2d(width_out),
        ]
        super().__init__(*layers, *([nn.ReLU()] if relu else []))


class SqueezeExcitation(nn.Module):
    """Channel gates from the pooled input: ``x * sigmoid(fc2(relu(fc1(mean(x)))))``."""

    def __init__(self, width: int, squeezed: int):
        super().__init__()
        self.fc1 = nn.Conv2d(width, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, width, 1)

    def forward(self, x):
        scale = self.fc2(torch.relu(self.fc1(x.mean(dim=(2, 3), keepdim=True))))
        return x * torch.sigmoid(scale)


class YBlock(nn.Module):
    """Residual bottleneck with SE (bottleneck multiplier 1); the SE width is
    ``se_ratio`` of the block's input width."""

    def __init__(self, width_in, width, stride, group_width, se_ratio):
        super().__init__()
        self.proj = None
        if stride != 1 or width_in != width:
            self.proj = ConvBN(width_in, width, 1, stride, relu=False)
        self.f = nn.Sequential(
            OrderedDict(
                a=ConvBN(width_in, width, 1),
                b=ConvBN(width, width, 3, stride, groups=width // group_width),
                se=SqueezeExcitation(width, int(round(se_ratio * width_in))),
                c=ConvBN(width, width, 1, relu=False),
            )
        )

    def forward(self, x):
        shortcut = x if self.proj is None else self.proj(x)
        return torch.relu(shortcut + self.f(x))


class TorchRegNet(nn.Module):
    """RegNetY with ``stages`` = ``[(width, blocks, group width), ...]``, each stage starting
    with a stride-2 block; ``taps`` returns jssl's taps (NCHW) and the ``fc`` logits."""

    def __init__(self, stages, stem_width=32, se_ratio=0.25, num_classes=10):
        super().__init__()
        self.stem = ConvBN(3, stem_width, 3, 2)
        width_in, trunk = stem_width, []
        for s, (width, blocks, group_width) in enumerate(stages, start=1):
            stage = OrderedDict()
            for i in range(blocks):
                stride = 2 if i == 0 else 1
                stage[f"block{s}-{i}"] = YBlock(width_in, width, stride, group_width, se_ratio)
                width_in = width
            trunk.append((f"block{s}", nn.Sequential(stage)))
        self.trunk_output = nn.Sequential(OrderedDict(trunk))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width_in, num_classes)

    def taps(self, x):
        out = {"conv1": self.stem(x)}
        x = out["conv1"]
        for s, stage in enumerate(self.trunk_output, start=2):
            x = stage(x)
            out[f"res{s}"] = x
        out["avgpool"] = torch.flatten(self.avgpool(x), 1)
        out["logits"] = self.fc(out["avgpool"])
        return out
