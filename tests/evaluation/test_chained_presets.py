"""The "test" presets that are meant to chain do: configs/svm.py:test, low_shot.py:test and
cluster.py:test read what configs/extract_features.py:test writes with nothing but the
features directory set, and a split that was not extracted is refused with a message listing
what was, and the flag that reads it."""

import pytest

from configs import cluster as cluster_config
from configs import extract_features as extract_config
from configs import low_shot as low_shot_config
from configs import svm as svm_config
from jssl import engines


@pytest.fixture(scope="module")
def features(shared_dirs, tmp_path_factory):
    """configs/extract_features.py:test on a tiny trained MoCo workdir."""
    from support.runs import tiny_trained_workdir

    config = extract_config.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = tiny_trained_workdir(tmp_path_factory)
    config.extract.layers = ("avgpool",)  # the evaluators' test presets read avgpool alone
    workdir = str(tmp_path_factory.mktemp("features"))
    engines.run(config, workdir)
    return workdir


@pytest.mark.parametrize(
    "module, section",
    [(svm_config, "svm"), (low_shot_config, "svm"), (cluster_config, "cluster")],
)
def test_evaluator_test_presets_read_the_extract_test_preset(features, tmp_path, module, section):
    config = module.get_config("test")
    config[section].features_dir = features
    results = engines.run(config, str(tmp_path / "out"))
    assert set(results["layers"]) == {"avgpool"}
    assert results["layers"]["avgpool"]["protocol"]["train_split"] == "train[:64]"


def test_a_split_not_extracted_lists_what_was_and_the_flag_that_reads_it(features, tmp_path):
    config = svm_config.get_config("test")
    config.svm.features_dir = features
    config.svm.train_split = "train"  # extract_features.py:test wrote train[:64] only
    with pytest.raises(FileNotFoundError) as refused:
        engines.run(config, str(tmp_path / "out"))
    message = str(refused.value)
    assert "found: nothing" not in message
    assert "train@0-64 (examples [0:64] of the 8000 of 'train')" in message
    assert "test@0-40 (examples [0:40] of the 2000 of 'test')" in message
    assert "--config.svm.train_split='train[:64]'" in message
    assert """--config.extract.splits='("train",)'""" in message
