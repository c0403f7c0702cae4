"""Simulating a host where packages are not installed, for subprocesses: the code that wraps
every import finder so that the named packages are never found (importlib.util.find_spec
returns None and ``import`` raises ModuleNotFoundError)."""

_HIDE = """
import sys

HIDDEN = {hidden!r}


class _Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Hide(finder) for finder in sys.meta_path]
"""


def hiding(*packages: str) -> str:
    """Python source that hides ``packages`` from the imports that follow it."""
    return _HIDE.format(hidden=tuple(packages))


def prepare_array_record_demo(root: str, train: int, test: int) -> str:
    """The demo dataset's first ``train`` / ``test`` examples prepared under ``root`` in
    ArrayRecord files (random access; seconds, not the full 10,000 images). Needs TFDS and
    TensorFlow, as `tfds build` does."""
    import tensorflow_datasets as tfds

    from jssl.data import demo, demo_tfds, sources  # noqa: F401  (demo_tfds registers it)

    sizes = dict(demo.SPLIT_SIZES)
    demo.SPLIT_SIZES.update(train=train, test=test)
    try:
        builder = tfds.builder(sources.DEMO_NAME, data_dir=root, file_format="array_record")
        builder.download_and_prepare()
    finally:
        demo.SPLIT_SIZES.update(sizes)
    return root
