"""VGG-16, MobileNetV2 and GoogLeNet: the MONeT workloads (ICLR'22 §5, Fig. 3, Table 1) MAGIS' seven lack.

MONeT traced torchvision's definitions of these networks. torchvision cannot be a
dependency here (each release pins one torch build), so the three are written from
their papers' architecture tables, in the form torchvision gives them:

- VGG-16 (Simonyan & Zisserman, ICLR 2015, Table 1 configuration D): thirteen 3x3
  convolutions with ReLU in five stages of 64-128-256-512-512 channels, each stage
  closed by 2x2 max-pooling, then three fully connected layers (4096, 4096, classes)
  with dropout 0.5 after the first two. No batch normalisation (torchvision's ``vgg16``).
  An adaptive average pooling to 7x7 sits before the classifier as in torchvision (the
  identity at 224x224). 138.36M parameters at 1000 classes.
- MobileNetV2 (Sandler et al., CVPR 2018, Table 2): a 3x3 stride-2 convolution to 32
  channels, seventeen inverted-residual bottlenecks (1x1 expansion by t, 3x3 depthwise,
  linear 1x1 projection; a residual connection where the stride is 1 and the width is
  kept), a 1x1 convolution to 1280, global average pooling, dropout 0.2 and the
  classifier. Batch normalisation after every convolution and ReLU6 (``hardtanh`` in the
  captured graph, as MONeT's Appendix G notes) after all but the projections.
  3.50M parameters at 1000 classes.
- GoogLeNet (Szegedy et al., CVPR 2015, Table 1), as torchvision's ``googlenet``: every
  convolution followed by batch normalisation (no local response normalisation) and
  ReLU; nine Inception modules of four branches (1x1; 1x1 reduce then 3x3; 1x1 reduce
  then the "5x5" branch, which torchvision, and so MONeT, builds with a 3x3 kernel;
  3x3 max-pooling then a 1x1 projection), max-pooling with ``ceil_mode``, global average
  pooling, dropout 0.2 and the classifier; the auxiliary classifiers off. 6.62M
  parameters at 1000 classes (with true 5x5 kernels it would be 7.0M).

Each takes ``divisor``: every channel count of the tables is divided by it (at least one
channel), so the ``tiny`` presets keep the topology at a fraction of the width. The
workloads train with cross-entropy on random labels (:class:`~magis.models.workloads.CrossEntropyTask`).

======================  =====  ==============================================
workload                batch  configuration (preset ``paper``, MONeT §5)
======================  =====  ==============================================
vgg16                   176    image 224, 1000 classes
mobilenet-v2            272    image 224, 1000 classes (Fig. 3; Table 1: 256)
googlenet               320    image 224, 1000 classes
======================  =====  ==============================================

MONeT's batch sizes are the largest that baseline PyTorch trains on a 16 GB P100.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from magis.models.workloads import Built, CrossEntropyTask, Workload

#: VGG configuration D: the convolutions' output channels, stage by stage (each stage then max-pools)
VGG16_STAGES = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))

#: MobileNetV2 Table 2: (expansion t, output channels c, repeats n, first stride s) per bottleneck sequence
MOBILENET_V2_BOTTLENECKS = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)

#: GoogLeNet Table 1: per Inception module, (#1x1, #3x3 reduce, #3x3, #5x5 reduce, #5x5, pool proj);
#: ``None`` is a stride-2 max-pooling between modules
GOOGLENET_INCEPTIONS = (
    (64, 96, 128, 16, 32, 32),  # 3a
    (128, 128, 192, 32, 96, 64),  # 3b
    None,
    (192, 96, 208, 16, 48, 64),  # 4a
    (160, 112, 224, 24, 64, 64),  # 4b
    (128, 128, 256, 24, 64, 64),  # 4c
    (112, 144, 288, 32, 64, 64),  # 4d
    (256, 160, 320, 32, 128, 128),  # 4e
    None,
    (256, 160, 320, 32, 128, 128),  # 5a
    (384, 192, 384, 48, 128, 128),  # 5b
)


def _narrow(channels: int, divisor: int) -> int:
    """A table's channel count at ``1/divisor`` of the width (at least one channel)."""
    if divisor <= 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    return max(1, channels // divisor)


class VGGStage(nn.Sequential):
    """One resolution of VGG (a block of Simonyan & Zisserman's Table 1): 3x3 convolutions, each
    followed by ReLU, then 2x2 max-pooling. A class of its own, so that activation checkpointing
    per block (the yardstick's ``checkpoint-block`` peer) finds VGG's five blocks."""

    def __init__(self, in_channels: int, widths: list[int]) -> None:
        layers: list[nn.Module] = []
        for width in widths:
            # in place, as torchvision's: the convolution's backward reads its input, not its output
            layers += [nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(inplace=True)]
            in_channels = width
        super().__init__(*layers, nn.MaxPool2d(2, stride=2))


class VGG16(nn.Module):
    """VGG-16, configuration D of Simonyan & Zisserman (2015, Table 1), without batch normalisation.

    ``pool`` is the side of the feature map the classifier reads (adaptive average pooling):
    7 is the paper's 224x224 input after five halvings.
    """

    def __init__(self, num_classes: int = 1000, divisor: int = 1, pool: int = 7, dropout: float = 0.5) -> None:
        super().__init__()
        stages: list[nn.Module] = []
        channels = 3
        for widths in VGG16_STAGES:
            stages.append(VGGStage(channels, [_narrow(w, divisor) for w in widths]))
            channels = _narrow(widths[-1], divisor)
        self.features = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d(pool)
        hidden = _narrow(4096, divisor)
        self.classifier = nn.Sequential(
            nn.Linear(channels * pool * pool, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(images)), 1))


class ConvBNReLU6(nn.Sequential):
    """Convolution (no bias: batch normalisation follows), batch normalisation, ReLU6."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int = 1, groups: int = 1) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """MobileNetV2's bottleneck (Sandler et al. §3.3, Table 1): 1x1 expansion to ``t`` times the
    input's channels (left out where t = 1), 3x3 depthwise convolution, linear 1x1 projection;
    the input is added back where the block keeps the resolution and the width."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = in_channels * expansion
        layers: list[nn.Module] = [] if expansion == 1 else [ConvBNReLU6(in_channels, hidden, 1)]
        layers += [
            ConvBNReLU6(hidden, hidden, 3, stride, groups=hidden),
            # the linear bottleneck (§3.2): no non-linearity after the projection
            nn.Conv2d(hidden, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.residual else out


class MobileNetV2(nn.Module):
    """MobileNetV2 of Sandler et al. (2018, Table 2) at width ``1/divisor``."""

    def __init__(self, num_classes: int = 1000, divisor: int = 1, dropout: float = 0.2) -> None:
        super().__init__()
        channels = _narrow(32, divisor)
        layers: list[nn.Module] = [ConvBNReLU6(3, channels, 3, stride=2)]
        for expansion, width, repeats, stride in MOBILENET_V2_BOTTLENECKS:
            width = _narrow(width, divisor)
            for i in range(repeats):
                layers.append(InvertedResidual(channels, width, stride if i == 0 else 1, expansion))
                channels = width
        last = _narrow(1280, divisor)
        layers.append(ConvBNReLU6(channels, last, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(images), 1), 1))


class ConvBNReLU(nn.Sequential):
    """GoogLeNet's convolution as torchvision has it: no bias, batch normalisation (eps 1e-3), ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int = 1) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel, stride, (kernel - 1) // 2, bias=False),
            nn.BatchNorm2d(out_channels, eps=1e-3),
            nn.ReLU(inplace=True),
        )


class Inception(nn.Module):
    """An Inception module (Szegedy et al. §5, Fig. 2b): four branches concatenated along channels.

    The third branch reduces then applies a 3x3 convolution where the paper has 5x5: the
    torchvision network MONeT evaluated has it so.
    """

    def __init__(self, in_channels: int, widths: tuple[int, ...]) -> None:
        super().__init__()
        ones, reduce3, threes, reduce5, fives, pool_proj = widths
        self.branch1 = ConvBNReLU(in_channels, ones, 1)
        self.branch2 = nn.Sequential(ConvBNReLU(in_channels, reduce3, 1), ConvBNReLU(reduce3, threes, 3))
        self.branch3 = nn.Sequential(ConvBNReLU(in_channels, reduce5, 1), ConvBNReLU(reduce5, fives, 3))
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True), ConvBNReLU(in_channels, pool_proj, 1)
        )
        self.out_channels = ones + threes + fives + pool_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class GoogLeNet(nn.Module):
    """GoogLeNet (Inception v1, Szegedy et al. 2015, Table 1) with batch normalisation, as torchvision's
    ``googlenet(aux_logits=False)``, at width ``1/divisor``."""

    def __init__(self, num_classes: int = 1000, divisor: int = 1, dropout: float = 0.2) -> None:
        super().__init__()
        c64, c192 = _narrow(64, divisor), _narrow(192, divisor)
        # the stem: 7x7/2 convolution, pool, 1x1 then 3x3 convolutions, pool (Table 1's first rows)
        layers: list[nn.Module] = [
            ConvBNReLU(3, c64, 7, stride=2),
            nn.MaxPool2d(3, stride=2, ceil_mode=True),
            ConvBNReLU(c64, c64, 1),
            ConvBNReLU(c64, c192, 3),
            nn.MaxPool2d(3, stride=2, ceil_mode=True),
        ]
        channels = c192
        for i, widths in enumerate(GOOGLENET_INCEPTIONS):
            if widths is None:
                # torchvision pools 3x3/2 after 3b and 2x2/2 after 4e (Table 1 lists 3x3/2 for both)
                before_5a = i > 2
                layers.append(nn.MaxPool2d(2 if before_5a else 3, stride=2, ceil_mode=True))
                continue
            block = Inception(channels, tuple(_narrow(w, divisor) for w in widths))
            layers.append(block)
            channels = block.out_channels
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(channels, num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(images), 1), 1))


def _classification(network: nn.Module, sizes: dict, batch: int) -> Built:
    images = torch.randn(batch, 3, sizes["image"], sizes["image"])
    labels = torch.randint(0, sizes["classes"], (batch,), dtype=torch.int64)
    return Built(CrossEntropyTask(network), (images, labels))


def _build_vgg16(sizes: dict, batch: int) -> Built:
    return _classification(VGG16(sizes["classes"], sizes["divisor"], sizes["pool"]), sizes, batch)


def _build_mobilenet_v2(sizes: dict, batch: int) -> Built:
    return _classification(MobileNetV2(sizes["classes"], sizes["divisor"]), sizes, batch)


def _build_googlenet(sizes: dict, batch: int) -> Built:
    return _classification(GoogLeNet(sizes["classes"], sizes["divisor"]), sizes, batch)


# The ``small`` presets keep the paper's architecture and 224x224 images at a small batch.
# Measured: peak live tensor memory of one eager CPU training step (forward + backward, no
# optimizer; magis.backend.meter.LiveTensorMeter, parameters, inputs and gradients included)
# and its seconds on one thread under that meter (one step, on a machine shared with other jobs):
#   vgg16 (batch 2)   1.15 GiB  4.9 s  (the weights and their gradients alone are 1.03 GiB)
#   mobilenet-v2 (16) 1.19 GiB  4.5 s
#   googlenet (16)    0.75 GiB  7.7 s
# ``tiny`` divides every width by 8 (VGG-16: by 16, and pools its 1x1 map to 1x1 for the classifier).
_IMAGENET = dict(image=224, classes=1000, divisor=1)
_TINY = dict(image=32, classes=10, divisor=8, batch=2)

CONVNET_WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "vgg16",
        "VGG-16 image classification (Simonyan & Zisserman 2015, configuration D), magis.models.convnets.VGG16",
        {
            "tiny": dict(_TINY, divisor=16, pool=1),
            "small": dict(_IMAGENET, pool=7, batch=2),
            "paper": dict(_IMAGENET, pool=7, batch=176),
        },
        _build_vgg16,
    ),
    Workload(
        "mobilenet-v2",
        "MobileNetV2 image classification (Sandler et al. 2018), magis.models.convnets.MobileNetV2",
        {
            "tiny": dict(_TINY),
            "small": dict(_IMAGENET, batch=16),
            "paper": dict(_IMAGENET, batch=272),
        },
        _build_mobilenet_v2,
    ),
    Workload(
        "googlenet",
        "GoogLeNet image classification (Szegedy et al. 2015, with batch norm), magis.models.convnets.GoogLeNet",
        {
            "tiny": dict(_TINY),
            "small": dict(_IMAGENET, batch=16),
            "paper": dict(_IMAGENET, batch=320),
        },
        _build_googlenet,
    ),
)
