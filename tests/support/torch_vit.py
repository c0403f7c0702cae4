"""A timm-layout PyTorch ViT (timm is not a dependency), shared by the tests of ViT weight
import and export; with LayerScale, registers or SwiGLU it is DINOv2's DinoVisionTransformer
(facebookresearch/dinov2 models/vision_transformer.py) in its layout."""

import torch

F = torch.nn.functional


class TorchViT(torch.nn.Module):
    """A PyTorch ViT with timm's state-dict layout and forward (timm/models/
    vision_transformer.py VisionTransformer with dynamic_img_size=True, class token, no
    head): the reference the jssl trunk must match. ``get_class_tokens`` returns the normed
    class token after each block, as timm's / DINO's get_intermediate_layers(norm=True)."""

    def __init__(
        self,
        image_size=224,
        patch=16,
        dim=192,
        depth=12,
        heads=3,
        layerscale=0.0,
        registers=0,
        swiglu=False,
    ):
        super().__init__()
        self.heads, self.patch, self.swiglu = heads, patch, swiglu
        self.patch_embed = torch.nn.Module()
        self.patch_embed.proj = torch.nn.Conv2d(3, dim, patch, patch)
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pos_embed = torch.nn.Parameter(torch.randn(1, 1 + (image_size // patch) ** 2, dim))
        self.blocks = torch.nn.ModuleList()
        for _ in range(depth):
            block = torch.nn.Module()
            block.norm1 = torch.nn.LayerNorm(dim, eps=1e-6)
            block.attn = torch.nn.Module()
            block.attn.qkv = torch.nn.Linear(dim, 3 * dim)
            block.attn.proj = torch.nn.Linear(dim, dim)
            block.norm2 = torch.nn.LayerNorm(dim, eps=1e-6)
            block.mlp = torch.nn.Module()
            if swiglu:  # DINOv2's SwiGLUFFNFused: hidden 2/3 of 4 x dim, rounded up to 8
                hidden = (int(4 * dim * 2 / 3) + 7) // 8 * 8
                block.mlp.w12 = torch.nn.Linear(dim, 2 * hidden)
                block.mlp.w3 = torch.nn.Linear(hidden, dim)
            else:
                block.mlp.fc1 = torch.nn.Linear(dim, 4 * dim)
                block.mlp.fc2 = torch.nn.Linear(4 * dim, dim)
            if layerscale:  # DINOv2's ls1 / ls2
                for name in ("ls1", "ls2"):
                    setattr(block, name, torch.nn.Module())
                    getattr(block, name).gamma = torch.nn.Parameter(
                        layerscale + 0.1 * torch.randn(dim)
                    )
            self.blocks.append(block)
        if registers:  # DINOv2's register_tokens, after the class token, no position
            self.register_tokens = torch.nn.Parameter(torch.randn(1, registers, dim) * 0.1)
        self.norm = torch.nn.LayerNorm(dim, eps=1e-6)
        with torch.no_grad():  # non-trivial norms and biases
            for name, p in self.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)

    def _attention(self, block, x):
        b, t, d = x.shape
        qkv = block.attn.qkv(x).reshape(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return block.attn.proj(out.transpose(1, 2).reshape(b, t, d))

    def get_class_tokens(self, x):
        x = self.patch_embed.proj(x)
        b, d, h, w = x.shape
        old = int(round((self.pos_embed.shape[1] - 1) ** 0.5))
        grid = self.pos_embed[:, 1:].reshape(1, old, old, d).permute(0, 3, 1, 2)
        # timm's resample_abs_pos_embed: bicubic with antialiasing
        grid = F.interpolate(grid, size=(h, w), mode="bicubic", antialias=True)
        pos = torch.cat([self.pos_embed[:, :1], grid.permute(0, 2, 3, 1).reshape(1, h * w, d)], 1)
        x = torch.cat([self.cls_token.expand(b, -1, -1), x.flatten(2).transpose(1, 2)], 1) + pos
        if hasattr(self, "register_tokens"):
            regs = self.register_tokens.expand(b, -1, -1)
            x = torch.cat([x[:, :1], regs, x[:, 1:]], 1)
        tokens = []
        for block in self.blocks:
            scale1 = block.ls1.gamma if hasattr(block, "ls1") else 1.0
            scale2 = block.ls2.gamma if hasattr(block, "ls2") else 1.0
            x = x + scale1 * self._attention(block, block.norm1(x))
            x = x + scale2 * self._mlp(block, block.norm2(x))
            tokens.append(self.norm(x))
        return tokens

    def _mlp(self, block, x):
        if self.swiglu:
            first, second = block.mlp.w12(x).chunk(2, dim=-1)
            return block.mlp.w3(F.silu(first) * second)
        return block.mlp.fc2(F.gelu(block.mlp.fc1(x)))
