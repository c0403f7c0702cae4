"""iBOT's start-up checks (jssl.methods.ibot's ``check_config``): DINO's, then the ViT every
masked-image method needs, the masks, the patch temperatures and centre, the shared last
layers."""

from __future__ import annotations

import ml_collections

from jssl.methods import distillation, masked_student


def check_config(config: ml_collections.ConfigDict) -> None:
    """DINO's start-up checks (crops, temperatures, momenta, head sizes), then iBOT's."""
    distillation.check_config(config)
    masked_student.check_vit(config)
    m = config.method
    ratios, variations = tuple(m.pred_ratio), tuple(m.pred_ratio_var)
    if len(variations) == 1:
        variations *= len(ratios)
    bad = len(ratios) != len(variations) or any(
        not 0.0 <= r - v <= r + v <= 1.0 for r, v in zip(ratios, variations, strict=False)
    )
    if not ratios or bad:
        raise ValueError(
            f"method.pred_ratio={ratios} and method.pred_ratio_var={tuple(m.pred_ratio_var)}: "
            "each ratio r with its variation v (one v for all, or one per r) must satisfy "
            "0 <= r - v <= r + v <= 1; iBOT's ViT recipes: --config.method.pred_ratio='(0.0, "
            "0.3)' --config.method.pred_ratio_var='(0.0, 0.2)'."
        )
    if m.pred_shape not in ("block", "rand"):
        raise ValueError(f"method.pred_shape={m.pred_shape!r}: use 'block' or 'rand'.")
    if m.pred_start_epoch < 0:
        raise ValueError(f"method.pred_start_epoch={m.pred_start_epoch} must be >= 0.")
    for field in ("warmup_teacher_patch_temp", "teacher_patch_temp"):
        if m[field] <= 0:
            raise ValueError(f"method.{field}={m[field]} must be positive (iBOT: 0.04 to 0.07).")
    if not 0.0 <= m.patch_center_momentum <= 1.0:
        raise ValueError(
            f"method.patch_center_momentum={m.patch_center_momentum} must lie in [0, 1]."
        )
    if int(m.patch_out_dim) < 1:
        raise ValueError(f"method.patch_out_dim={m.patch_out_dim} must be a positive integer.")
    if (m.shared_head or m.shared_head_teacher) and int(m.patch_out_dim) != int(m.out_dim):
        raise ValueError(
            f"method.patch_out_dim={m.patch_out_dim} differs from method.out_dim={m.out_dim}, "
            "but a last layer is shared by [CLS] and patches (method.shared_head="
            f"{m.shared_head}, method.shared_head_teacher={m.shared_head_teacher}): set "
            f"--config.method.patch_out_dim={m.out_dim}, or both shared_head fields False."
        )
