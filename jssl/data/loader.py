"""The input pipeline's entry points: a training epoch's and an evaluation split's batches,
from tf.data (jssl.data.pipeline), grain (jssl.data.grain_pipeline) or, for the demo data, a
numpy pipeline (jssl.data.numpy_pipeline), as jssl.data.backend picks per config
(``data.loader``). The pipelines are imported only here, when a dataset is built."""

from __future__ import annotations

from jssl.data import backend


def _pipeline(data_config):
    loader = backend.resolve(data_config)
    if loader == "numpy":
        from jssl.data import numpy_pipeline

        return numpy_pipeline
    if loader == "grain":
        from jssl.data import grain_pipeline

        return grain_pipeline
    backend.require_tensorflow(data_config)
    from jssl.data import pipeline

    return pipeline


def build_train_dataset(
    data_config,
    *,
    seed: int,
    epoch: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
):
    """This process's batches of one training epoch: {"crops", "label", "index", "replaced"}
    (and "aug_seeds" where the step makes the views); see jssl.data.pipeline's twin for the
    layout. A tf.data.Dataset, or grain's or the numpy pipeline's Batches; all have
    as_numpy_iterator()."""
    return _pipeline(data_config).build_train_dataset(
        data_config,
        seed=seed,
        epoch=epoch,
        start_step=start_step,
        process_index=process_index,
        process_count=process_count,
    )


def build_eval_dataset(
    data_config,
    split: str,
    *,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
):
    """This process's batches over the whole ``split``: {"image", "label", "index", "mask"},
    padded to static shapes (jssl.data.pipeline.build_eval_dataset)."""
    return _pipeline(data_config).build_eval_dataset(
        data_config,
        split,
        batch_size=batch_size,
        process_index=process_index,
        process_count=process_count,
    )
