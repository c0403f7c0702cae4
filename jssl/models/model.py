"""A trunk with an optional head, returning every named feature tap.

This is VISSL's ``BaseSSLMultiInputOutputModel`` (``vissl/models/base_ssl_model.py``)
reduced to what the methods need: the trunk's taps (for feature extraction and
linear evaluation) plus the head's output under ``"head"`` (for the SSL loss).

Multi-crop input is VISSL's ``multi_res_input_forward``: given a list of image batches (one per
resolution), the trunk runs once per batch and the head once on all trunk features
concatenated, so the head's batch norm sees every crop.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class TrunkAndHead(nn.Module):
    """``trunk(x)`` taps, plus ``"head"`` = ``head(taps[head_input])`` when a head is set.

    Submodules are named ``trunk`` and ``head`` so their parameters live under
    ``params["trunk"]`` / ``params["head"]``, which lets optimizers and weight
    import treat them separately (e.g. a frozen trunk in linear evaluation).
    """

    trunk: nn.Module
    head: nn.Module | None = None
    head_input: str = "avgpool"  # which trunk tap feeds the head

    @nn.compact
    def __call__(
        self, x: jax.Array | Sequence[jax.Array], train: bool = True, **trunk_kwargs
    ) -> dict[str, jax.Array]:
        """``trunk_kwargs`` (a ViT's ``mask``, ``keep``, ``row_keys``) go to the trunk; with a
        list of inputs, each is a list of the same length, one entry per input."""
        if isinstance(x, (list, tuple)):
            taps = self._multi_resolution(x, train, trunk_kwargs)
        else:
            taps = dict(self.trunk(x, train=train, **trunk_kwargs))
        if self.head is not None:
            if self.head_input not in taps:
                raise KeyError(
                    f"head_input={self.head_input!r} is not a trunk tap; "
                    f"available taps: {sorted(taps)}"
                )
            taps["head"] = self.head(taps[self.head_input], train=train)
        return taps

    def _multi_resolution(
        self, inputs: Sequence[jax.Array], train: bool, trunk_kwargs: dict
    ) -> dict[str, jax.Array]:
        """The trunk on each input; the taps whose shapes agree across inputs (avgpool, not
        the spatial maps of different resolutions) concatenated along the batch."""
        for name, value in trunk_kwargs.items():
            if not isinstance(value, (list, tuple)) or len(value) != len(inputs):
                raise ValueError(
                    f"{name}= must be a list with one entry per input ({len(inputs)} inputs)."
                )
        per_input = [
            dict(self.trunk(x, train=train, **{k: v[i] for k, v in trunk_kwargs.items()}))
            for i, x in enumerate(inputs)
        ]
        return {
            name: jnp.concatenate([t[name] for t in per_input])
            for name in per_input[0]
            if len({t[name].shape[1:] for t in per_input}) == 1
        }
