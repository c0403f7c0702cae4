"""Image folders (data.source="folder"): data.data_dir/<split>/<class_name>/<image files>.

A split is a sub-folder of data.data_dir; its classes are its sub-folders in sorted order, and
its examples are sorted by class then file name, so dataset indices are stable across runs and
any example can be read on its own (`SplitSource.random_access`). The records carry file paths;
jssl.data.decoding reads and decodes them.
"""

from __future__ import annotations

import functools
import os

import numpy as np

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
def list_image_folder(root: str, split: str) -> tuple[tuple[str, ...], np.ndarray, tuple[str, ...]]:
    """(paths, labels, class_names) of root/split/<class>/<file>, sorted; listed once a process."""
    split_dir = os.path.join(root, split)
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(
            f"Image folder {split_dir!r} does not exist. data.source='folder' expects "
            "data.data_dir/<split>/<class_name>/<image files>; set data.data_dir to the root and "
            "data.train_split/test_split to the sub-folder names."
        )
    class_names = tuple(
        sorted(d for d in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d)))
    )
    if not class_names:
        raise FileNotFoundError(
            f"No class sub-folders in {split_dir!r}: expected {split_dir}/<class_name>/<images>."
        )
    paths, labels = [], []
    for label, name in enumerate(class_names):
        class_dir = os.path.join(split_dir, name)
        files = sorted(f for f in os.listdir(class_dir) if f.lower().endswith(IMAGE_EXTENSIONS))
        paths.extend(os.path.join(class_dir, f) for f in files)
        labels.extend([label] * len(files))
    if not paths:
        raise FileNotFoundError(
            f"No image files ({', '.join(IMAGE_EXTENSIONS)}) under the class folders of "
            f"{split_dir!r}."
        )
    return tuple(paths), np.asarray(labels, np.int32), class_names


def resolve_folder(data_config, split: str) -> SplitSource:
    """``split`` of data.source="folder": the sub-folder of data.data_dir of that name."""
    if not data_config.data_dir:
        raise ValueError('data.source="folder" needs data.data_dir (the root folder).')
    root = os.fspath(data_config.data_dir)
    check_folder_split(data_config, root, split)
    paths, labels, _ = list_image_folder(root, split)
    return SplitSource(
        kind="folder", split=split, num_examples=len(paths), paths=paths, labels=labels
    )
