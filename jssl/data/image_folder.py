"""Image folders (data.source="folder"): data.data_dir/<split>/<class_name>/<image files>.

A split is a sub-folder of data.data_dir. Every split is labelled from one class list, the class
folders of the training split (data.train_split) in sorted order: label i is the i-th of them in
train, test and any other split, so a test split that lacks some classes keeps train's numbers,
and a class folder that train lacks is refused. A class folder without images, or one that leads
back to its own split (a symlink), is refused too rather than becoming a class without examples.
Examples are sorted by class then file name, so dataset indices are stable across runs and any
example can be read on its own (`SplitSource.random_access`). The records carry file paths;
jssl.data.decoding reads and decodes them. The class list is logged when a split is listed (once
a process) and kept in `SplitSource.class_names`.
"""

from __future__ import annotations

import functools
import os

import numpy as np
from absl import logging

from jssl.data.split_source import SplitSource, unknown_split_error

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")


def check_folder_split(data_config, root: str, split: str) -> str:
    """root/split, refusing names that would read outside root and naming the available splits."""
    parts = split.replace("\\", "/").split("/")
    if not split or os.path.isabs(split) or ".." in parts:
        raise ValueError(
            f"Split {split!r} is not a sub-folder name: data.source='folder' reads only "
            f"data.data_dir/<split>/, so absolute paths and '..' are refused. Point data.data_dir "
            "at the root folder and set the split to the name of a folder inside it."
        )
    split_dir = os.path.join(root, split)
    if os.path.isdir(root) and not os.path.isdir(split_dir):
        available = [d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))]
        error = unknown_split_error(data_config, split, available)
        if "[" in split:
            error = ValueError(
                f"{error} Image folders do not support TFDS slicing; use data.train_subset."
            )
        raise error
    return split_dir


@functools.lru_cache(maxsize=16)
def class_folders(root: str, split: str) -> tuple[str, ...]:
    """The class folders of root/split, sorted; a folder that resolves to the split folder or
    one above it (a symlink) is refused: its entries are folders, not one class's images."""
    split_dir = os.path.join(root, split)
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(
            f"Image folder {split_dir!r} does not exist. data.source='folder' expects "
            "data.data_dir/<split>/<class_name>/<image files>; set data.data_dir to the root and "
            "data.train_split/test_split to the sub-folder names."
        )
    names = tuple(
        sorted(d for d in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d)))
    )
    if not names:
        raise FileNotFoundError(
            f"No class sub-folders in {split_dir!r}: expected {split_dir}/<class_name>/<images>."
        )
    split_real = os.path.realpath(split_dir)
    for name in names:
        target = os.path.realpath(os.path.join(split_dir, name))
        if os.path.commonpath([split_real, target]) == target:
            where = "the split folder itself" if target == split_real else "a folder above it"
            raise ValueError(
                f"Class folder {os.path.join(split_dir, name)!r} of split {split!r} leads back to "
                f"{target!r}, {where} (a symlink?), so it would be an extra class of folders, not "
                "images. Remove it, or make it a folder (or a link to one) of that class's images."
            )
    return names


def _names_line(class_names: tuple[str, ...], shown: int = 8) -> str:
    """'0 a, 1 b, ...' for the log, the middle left out of a long list."""
    numbered = [f"{i} {name}" for i, name in enumerate(class_names)]
    if len(numbered) > shown:
        numbered = [*numbered[: shown - 2], "...", *numbered[-2:]]
    return ", ".join(numbered)


def _unknown_classes_error(split_dir: str, split: str, classes_from: str, unknown) -> ValueError:
    return ValueError(
        f"Class folder(s) {unknown} of split {split!r} ({split_dir}) are not class folders of "
        f"the training split {classes_from!r}: every split of an image folder is labelled by "
        "data.train_split's class folders, so their images would have no label. Remove them "
        f"from {split!r}, add them with their images to {classes_from!r}, or set "
        "--config.data.train_split to the split whose class folders label the others."
    )


@functools.lru_cache(maxsize=16)
def list_image_folder(
    root: str, split: str, classes_from: str = ""
) -> tuple[tuple[str, ...], np.ndarray, tuple[str, ...]]:
    """(paths, labels, class_names) of root/split/<class>/<file>, sorted, labelled by position
    among the class folders of root/``classes_from`` (default: ``split``'s own); refuses a class
    folder ``classes_from`` lacks and one without images. Listed once a process."""
    split_dir = os.path.join(root, split)
    found = class_folders(root, split)
    class_names = class_folders(root, classes_from) if classes_from else found
    label_of = {name: label for label, name in enumerate(class_names)}
    unknown = [name for name in found if name not in label_of]
    if unknown:
        raise _unknown_classes_error(split_dir, split, classes_from, unknown)
    paths, labels = [], []
    for name in found:
        class_dir = os.path.join(split_dir, name)
        files = sorted(f for f in os.listdir(class_dir) if f.lower().endswith(IMAGE_EXTENSIONS))
        if not files:
            raise FileNotFoundError(
                f"Class folder {class_dir!r} holds no image files ({', '.join(IMAGE_EXTENSIONS)}) "
                "directly inside it, so it would be a class without examples. Add its images or "
                "remove the folder."
            )
        paths.extend(os.path.join(class_dir, f) for f in files)
        labels.extend([label_of[name]] * len(files))
    logging.info(
        "Image folder %s: %d images in %d of %d classes, labelled by the class folders of %r: %s",
        split_dir,
        len(paths),
        len(found),
        len(class_names),
        classes_from or split,
        _names_line(class_names),
    )
    return tuple(paths), np.asarray(labels, np.int32), class_names


def resolve_folder(data_config, split: str) -> SplitSource:
    """``split`` of data.source="folder": the sub-folder of data.data_dir of that name, labelled
    by the class folders of data.train_split."""
    if not data_config.data_dir:
        raise ValueError('data.source="folder" needs data.data_dir (the root folder).')
    root = os.fspath(data_config.data_dir)
    check_folder_split(data_config, root, split)
    classes_from = data_config.train_split
    if classes_from != split:
        try:
            check_folder_split(data_config, root, classes_from)
        except ValueError as e:
            raise ValueError(
                f"{e} Every split of an image folder is labelled by the class folders of "
                f"data.train_split, so {split!r} needs it; set --config.data.train_split={split} "
                f"to label {split!r} by its own class folders."
            ) from None
    paths, labels, class_names = list_image_folder(root, split, classes_from)
    return SplitSource(
        kind="folder",
        split=split,
        num_examples=len(paths),
        paths=paths,
        labels=labels,
        class_names=class_names,
    )
