"""The test_loss engine: a trained method's own loss on a held-out split, as an evaluator.

VISSL's test phase (the training loss on ``DATA.TEST`` in eval mode, reported per epoch) run on
any checkpoint of a jssl workdir: from ``config.evals`` inside training or in the evaluate
engine, or alone (``configs/test_loss.py``). The method, its heads, teacher, queue or centre
and its data recipe are the trained run's (its ``config.json`` and its whole state but the
optimizer), so a weights file, or a ``method.name`` other than the run's, is refused. The
figure is the train engine's test phase (``jssl.evaluation.monitor.test_phase``): every
example of ``test_loss.split`` once, the centre crop fed as every view, batch norm on its
running statistics, nothing updated. It measures how well the encoders agree on clean images,
not the augmentation invariance the training loss measures, so it compares checkpoints of one
run, not methods. More: docs/evaluation.md, "Test loss".
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
from absl import logging

from jssl import methods, parallel
from jssl.checkpoints import run_config, source_model, weights
from jssl.data.sources import DEMO_NAME
from jssl.engines import svm as svm_engine
from jssl.evaluation import evaluators, frozen, monitor
from jssl.evaluation.results import make_writer, write_results
from jssl.training import progress


def check_settings(config: ml_collections.ConfigDict) -> None:
    """Start-up checks of ``config.test_loss`` (also for an entry run inside training)."""
    svm_engine.require_section(config, "test_loss", "configs/test_loss.py")
    t = config.test_loss
    if not isinstance(t.split, str) or not t.split:
        raise ValueError(f"test_loss.split={t.split!r} must name a split, e.g. 'test'.")
    batch = t.batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"test_loss.batch_size={batch!r} must be an integer >= 1, e.g. 256.")
    for count, what in ((jax.device_count(), "devices"), (jax.process_count(), "processes")):
        if batch % count:
            raise ValueError(
                f"test_loss.batch_size={batch} is not divisible by the {count} {what}; set "
                f"--config.test_loss.batch_size to a multiple of {count}."
            )
    if not isinstance(t.outputs, bool):
        raise ValueError(f"test_loss.outputs={t.outputs!r} must be True or False.")


def validate(config: ml_collections.ConfigDict) -> None:
    """The test_loss engine's start-up checks, run before anything is written to the workdir."""
    check_settings(config)
    path = config.init.checkpoint
    if not path:
        raise ValueError(
            "engine='test_loss' computes a trained method's loss: set --config.init.checkpoint "
            "to the jssl workdir that trained it (or one of its checkpoints/<step> dirs)."
        )
    if path.endswith(weights.TORCH_SUFFIXES):
        raise ValueError(
            f"init.checkpoint={path!r} is a weights file, which holds a trunk alone; the test "
            "loss needs the method's heads, teacher and config: pass the jssl workdir that "
            "trained it."
        )
    check_method(config, path)


def check_method(config: ml_collections.ConfigDict, path: str) -> None:
    """The loss is the trained method's own, so the method is the workdir's: a ``method.name``
    set here (the presets leave it empty) other than the one ``path``'s config.json records
    is refused rather than ignored."""
    wanted = config.method.name
    trained = run_config.recorded_config(path).get("method.name")
    if wanted and trained and wanted != trained:
        raise ValueError(
            f"method.name={wanted!r}, but {path} trained {trained!r} (its config.json): the "
            "test loss is the trained method's own loss, computed with the heads, teacher and "
            f"state its checkpoint holds, so the method is the workdir's, {trained!r}. Drop "
            f"--config.method.name, or point --config.init.checkpoint at a workdir that trained "
            f"{wanted!r}."
        )


def training_config(config: ml_collections.ConfigDict, path: str) -> ml_collections.ConfigDict:
    """The config the loss is computed under: the trained run's (recorded with the weights at
    ``path``) with this config's model fields, ``test_loss.split`` as its test split and the
    kNN monitor off. Its batch size stays the run's: the method's schedules count epochs in
    its steps (``run`` reads the split in batches of ``test_loss.batch_size``)."""
    try:
        train = source_model.method_config(config, path)
    except ValueError:
        raise ValueError(
            f"{path} has no jssl config.json naming the method that trained it; the test loss "
            "needs it: pass the jssl workdir of the training run."
        ) from None
    t = config.test_loss
    with train.unlocked():
        train.data.test_split = t.split
        train.knn.enabled = False
        train.eval_outputs = t.outputs
    return train


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """The method's loss on ``test_loss.split`` at the checkpoint ``init.checkpoint`` names
    (a workdir: its newest readable one); writes and returns results.json's content."""
    validate(config)
    path = evaluators.resolve(config.init.checkpoint)
    train = training_config(config, path)
    mesh = parallel.make_mesh()
    steps_per_epoch = progress.steps_per_epoch(train)  # at the run's batch size
    method = methods.get(train, steps_per_epoch)
    state, state_dir = frozen.load_train_state(train, method, mesh, path)
    with train.unlocked():
        train.data.batch_size = config.test_loss.batch_size  # the evaluation pass's
    step = int(jax.device_get(state.step))
    writer = make_writer(workdir)
    eval_step = monitor.make_test_step(train, method, mesh)
    phase = monitor.test_phase(
        train,
        eval_step,
        None,  # no kNN monitor, so no trunk forward of its own
        state,
        mesh,
        workdir=workdir,
        epoch=step // steps_per_epoch,
        writer=writer,
        step=step,
    )
    results: dict[str, Any] = {"evaluator": "test_loss", "loss": phase.pop("loss")}
    # Each term exactly over the split; the step's weighting bookkeeping (loss_weight/*,
    # loss/*_weighted: batch means, constant weights) is left out.
    results["terms"] = {t.name: phase[f"loss/{t.name}"] for t in methods.loss_terms(train)}
    results["num_examples"] = phase.pop("num_examples")
    results["metrics"] = {
        k: v for k, v in phase.items() if not k.startswith(("loss/", "loss_weight/"))
    }
    results["protocol"] = _protocol(config, train, state_dir, step)
    scalars = {"test_loss/loss": results["loss"]}
    scalars.update({f"test_loss/{k}": v for k, v in results["terms"].items()})
    scalars.update({f"test_loss/{k}": v for k, v in results["metrics"].items()})
    writer.write_scalars(step, scalars)
    writer.flush()
    write_results(workdir, results)
    line = (
        f"Test loss of {train.method.name} on {train.data.test_split} at step {step}: "
        f"{results['loss']:.4f} ({results['num_examples']} examples)"
    )
    logging.info(line)
    if jax.process_index() == 0:
        print(line, flush=True)
    return results


def _protocol(config, train, state_dir: str, step: int) -> dict[str, Any]:
    record = evaluators.protocol(config, "test_loss", evaluators.EVALUATORS["test_loss"], False)
    d = train.data
    record.update(
        method=train.method.name,
        checkpoint=state_dir.removesuffix("/state"),
        checkpoint_step=step,
        dataset={
            "source": d.source,
            "name": d.name or (DEMO_NAME if d.source == "demo" else d.source),
            "data_dir": d.data_dir,
            "image_size": d.image_size,
        },
        split=d.test_split,
        views=(
            "the centre crop (evaluation transform) fed as every crop of the method's crop "
            "groups, resized to each group's size; eval mode, no state updated"
        ),
    )
    return record
