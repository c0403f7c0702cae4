"""A trunk with an optional head, returning every named feature tap.

This is VISSL's ``BaseSSLMultiInputOutputModel`` (``vissl/models/base_ssl_model.py``)
reduced to what the methods need: the trunk's taps (for feature extraction and
linear evaluation) plus the head's output under ``"head"`` (for the SSL loss).
"""

from __future__ import annotations

import flax.linen as nn
import jax


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
    def __call__(self, x: jax.Array, train: bool = True) -> dict[str, jax.Array]:
        taps = dict(self.trunk(x, train=train))
        if self.head is not None:
            if self.head_input not in taps:
                raise KeyError(
                    f"head_input={self.head_input!r} is not a trunk tap; "
                    f"available taps: {sorted(taps)}"
                )
            taps["head"] = self.head(taps[self.head_input], train=train)
        return taps
