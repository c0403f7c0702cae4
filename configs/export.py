r"""Export a trained trunk to PyTorch: a ResNet as torchvision's ``ResNet`` state dict, a ViT
as timm's ``VisionTransformer`` one (``jssl/engines/export.py``), for detection or
segmentation code in PyTorch.

  python launch.py --config=configs/moco.py:demo --workdir=runs/demo          # train first
  python launch.py --config=configs/export.py:demo --workdir=runs/demo_export \
      --config.init.checkpoint=runs/demo

writes ``trunk.safetensors``, ``trunk.pth`` (where torch is installed) and ``export.json``
(the architecture, the torchvision / timm constructor that builds the matching model, the
source checkpoint and its step). The model fields come from the source workdir's config.json
(jssl.checkpoints.source_model), as for the evaluation engines; a ``--config.model.*`` flag
wins. ``init.checkpoint`` is a jssl workdir (its newest complete checkpoint), one
``checkpoints/<step>`` dir, or a .torch/.pth/.safetensors file (converted to torchvision's or
timm's names). ``--config.init.checkpoint=runs/demo_export/trunk.safetensors`` reads an export
back into any engine.

Presets: "" (ImageNet ResNet-50: the model of a PyTorch file), "demo" (the demos' ResNet),
"test" (tiny, for the test suite).
"""

import ml_collections

from configs import base, recipes


def get_config(preset: str = "") -> ml_collections.ConfigDict:
    c = base.get_base_config()
    recipes.evaluation(c, "export", preset)
    c.export = ml_collections.ConfigDict()
    # Also write trunk.pth (torch.save of the same state dict) where torch imports;
    # trunk.safetensors is always written, without torch.
    c.export.pth = True
    return c
