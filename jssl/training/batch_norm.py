"""The start-up check that every batch-norm layer of a run normalises more than one example.

Batch norm in train mode over one example has a zero variance: its output is its bias for
every input and the step's loss soon non-finite, which the run would report as a learning-rate
problem. A layer normalises each device's micro-batch (``data.batch_size`` over the devices,
then over ``optim.accumulation_steps``), or the global micro-batch with ``model.sync_bn``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from jssl import methods

# The config fields that put batch norm into a part of the model, by the part's name.
_FIELDS = {
    "head": ("model.head_bn", "model.head_last_bn"),
    "predictor": ("method.predictor_bn", "method.predictor_last_bn"),
}


def examples_per_layer(config: ml_collections.ConfigDict) -> int:
    """How many examples each batch-norm layer normalises in one call."""
    devices = 1 if config.model.sync_bn else jax.device_count()
    return config.data.batch_size // devices // config.optim.get("accumulation_steps", 1)


def check_config(config: ml_collections.ConfigDict) -> None:
    """Refuses a run whose batch-norm layers would each normalise a single example, naming the
    layers' fields and the settings that give them more."""
    if examples_per_layer(config) >= 2:
        return
    size = config.data.image_size
    method = methods.get(config, 1)
    shapes = jax.eval_shape(method.init, jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)))
    parts = sorted(shapes.get("batch_stats") or {})
    if not parts:
        return  # no batch norm (a ViT trunk, heads without BN)
    steps = config.optim.get("accumulation_steps", 1)
    devices = 1 if config.model.sync_bn else jax.device_count()
    if config.model.sync_bn:
        share = "the global batch, model.sync_bn=True"
    else:
        share = f"each device's share, over {devices} device(s)"
    if steps > 1:
        share += f", in {steps} micro-batches (optim.accumulation_steps)"
    larger = [f"--config.data.batch_size={2 * steps * devices} or more"]
    if not config.model.sync_bn and config.data.batch_size // steps >= 2:
        larger.append("--config.model.sync_bn=True (statistics over the global batch)")
    if steps > 1:
        larger.append("fewer --config.optim.accumulation_steps")
    out = [f"--config.{field}=False" for field in _fields_on(config, parts)]
    if "trunk" in parts:
        out.append("a trunk without batch norm (a ViT: --config.model.trunk=vit_tiny ...)")
    named = ", ".join(_what_sets(config, part) for part in parts)
    raise ValueError(
        f"data.batch_size={config.data.batch_size} leaves every batch-norm layer one example "
        f"to normalise ({share}): its variance over one example is zero, and the loss would "
        f"soon be non-finite. Batch norm is in: {named}. Pass {', or '.join(larger)}; or "
        f"take the batch norm out: {', '.join(out)}."
    )


def _fields_on(config: ml_collections.ConfigDict, parts: list[str]) -> list[str]:
    """The boolean fields that turn on the batch norm of ``parts``."""
    on = []
    for part in parts:
        for field in _FIELDS.get(part, ()):
            section, name = field.split(".")
            if config[section].get(name, False):
                on.append(field)
    return on


def _what_sets(config: ml_collections.ConfigDict, part: str) -> str:
    fields = [f"{field}=True" for field in _fields_on(config, [part])]
    if part == "trunk":
        fields = [f"model.trunk={config.model.trunk}"]
    return f"{part} ({', '.join(fields)})" if fields else part
