"""A torchvision-layout ResNet in plain torch.nn (module names and v1.5 stride placement of
``torchvision/models/resnet.py``; torchvision itself is not a dependency), for the tests of
weight import from PyTorch files."""

import torch

nn = torch.nn

_BLOCKS = {18: ("basic", (2, 2, 2, 2)), 50: ("bottleneck", (3, 4, 6, 3))}


class TorchBasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.downsample = _downsample(inplanes, planes, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class TorchBottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        # v1.5: the stride is in the 3x3 conv.
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU()
        self.downsample = _downsample(inplanes, planes * 4, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


def _downsample(inplanes: int, out_channels: int, stride: int):
    if stride == 1 and inplanes == out_channels:
        return None
    return nn.Sequential(
        nn.Conv2d(inplanes, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
    )


class TorchResNet(nn.Module):
    """torchvision's ResNet layout, every width scaled by ``width_multiplier``; with
    ``cifar_stem`` a 3x3 stride-1 conv1 and no max-pool (jssl's ``model.cifar_stem``); no
    ``fc`` (an Identity) when ``num_classes`` is None, as for an exported trunk."""

    def __init__(
        self,
        depth: int,
        width_multiplier: float = 1.0,
        num_classes: int | None = 10,
        cifar_stem: bool = False,
    ):
        super().__init__()
        kind, blocks = _BLOCKS[depth]
        block = TorchBasicBlock if kind == "basic" else TorchBottleneck
        widths = [int(64 * width_multiplier * 2**i) for i in range(4)]
        if cifar_stem:
            self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        else:
            self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        self.maxpool = nn.Identity() if cifar_stem else nn.MaxPool2d(3, 2, 1)
        inplanes = widths[0]
        for stage, (planes, n) in enumerate(zip(widths, blocks, strict=True)):
            layers = []
            for b in range(n):
                layers.append(block(inplanes, planes, 2 if stage > 0 and b == 0 else 1))
                inplanes = planes * block.expansion
            setattr(self, f"layer{stage + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Identity() if num_classes is None else nn.Linear(inplanes, num_classes)

    def taps(self, x):
        out = {"conv1": self.conv1(x)}
        x = self.maxpool(self.relu(self.bn1(out["conv1"])))
        for stage in range(4):
            x = getattr(self, f"layer{stage + 1}")(x)
            out[f"res{stage + 2}"] = x
        out["avgpool"] = torch.flatten(self.avgpool(x), 1)
        out["logits"] = self.fc(out["avgpool"])
        return out
