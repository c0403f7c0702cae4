"""Checkpoints with orbax: save the TrainState and the data position, auto-resume.

Layout: ``workdir/checkpoints/<step>/{state,data}``. orbax writes each step to a temporary
directory and renames it when complete, so a process killed mid-save leaves the previous
checkpoints as they were and the partial one is never picked up. The resume order is
written down once, in ``restore_or_none``: the newest readable checkpoint in the workdir,
older ones if the newest is unreadable, else nothing (the caller then starts from ``init``
weights or from scratch).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where in the data a checkpoint was taken: the next batch to train on."""

    epoch: int = 0
    step_in_epoch: int = 0


class CheckpointError(RuntimeError):
    pass


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def make_manager(workdir: str, *, max_to_keep: int, async_save: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=True,
        enable_async_checkpointing=async_save,
    )
    return ocp.CheckpointManager(
        checkpoint_dir(workdir), options=options, item_names=("state", "data")
    )


def resume(workdir: str, checkpoint_config: Any, state: Any):
    """The manager of ``workdir`` and the state to continue from: the newest readable
    checkpoint, or ``state`` itself (with a fresh data position) when there is none.

    Returns (manager, state, position, resumed).
    """
    manager = make_manager(
        workdir,
        max_to_keep=checkpoint_config.max_to_keep,
        async_save=checkpoint_config.async_save,
    )
    restored = restore_or_none(manager, state)
    if restored is None:
        return manager, state, DataPosition(), False
    return manager, restored[0], restored[1], True


def save(
    manager: ocp.CheckpointManager, state: Any, position: DataPosition, *, force: bool = False
) -> bool:
    step = int(jax.device_get(state.step))
    if step in manager.all_steps():
        return False
    saved = manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(dataclasses.asdict(position)),
        ),
        force=force,
    )
    if saved:
        logging.info(
            "Saving checkpoint of step %d (epoch %d, batch %d of the epoch).",
            step,
            position.epoch,
            position.step_in_epoch,
        )
    return saved


def restore_or_none(manager: ocp.CheckpointManager, target: Any) -> tuple[Any, DataPosition] | None:
    """Restores the newest readable checkpoint onto ``target``'s structure and shardings.

    A checkpoint that fails to read (truncated files, a wrong model config) is reported and
    the next older one is tried (newer unreadable ones are then renamed aside, see
    ``_move_aside``); if checkpoints exist but none is readable, this raises
    rather than silently training from scratch over them.
    """
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    errors = []
    for step in steps:
        try:
            restored = manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # noqa: BLE001 - any read failure means "try an older one"
            path = os.path.join(manager.directory, str(step))
            logging.error("Could not restore the checkpoint at %s: %s", path, e)
            errors.append(f"  {path}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        if step != steps[0]:
            _move_aside(manager, [s for s in steps if s > step])
        return restored["state"], DataPosition(**restored["data"])
    raise CheckpointError(
        "None of the checkpoints in "
        f"{manager.directory} could be restored:\n" + "\n".join(errors) + "\n"
        "If the model config changed since they were written, use the original config or a "
        "new --workdir; if they are corrupt, move them away to start over."
    )


def _move_aside(manager: ocp.CheckpointManager, unreadable: list[int]) -> None:
    """Renames unreadable checkpoints to ``<step>.unreadable-<time>``, which orbax ignores.

    Left in place, the run resumed from an older step would skip saving those steps again
    (``save`` never overwrites) and the next restart would meet the same unreadable files.
    """
    suffix = f"unreadable-{int(time.time())}"
    if jax.process_index() == 0:
        for step in unreadable:
            path = os.path.join(manager.directory, str(step))
            os.rename(path, f"{path}.{suffix}")
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jssl_checkpoint_move_aside")
    manager.reload()
    logging.warning(
        "Resumed from step %d: the newer, unreadable checkpoints %s were renamed to "
        "<step>.%s in %s; delete them once inspected.",
        manager.latest_step(),
        unreadable,
        suffix,
        manager.directory,
    )
