"""Evaluators as configuration: ``config.evals`` entries, the evaluate engine on a checkpoint
and following a training workdir, and the same evaluators run by the train engine. Figures
are checked against the standalone engines on the same checkpoint (the evaluate engine must
add nothing but the protocol), on the tiny "test" presets."""

import json
import os

import numpy as np
import pytest
from support.launch import enable_compilation_cache, prepare_shared_dirs

from configs import cluster as cluster_config
from configs import evaluate as evaluate_config
from configs import extract_features as extract_config
from configs import knn as knn_config
from configs import moco
from configs import svm as svm_config
from configs import test_loss as test_loss_config
from jssl import engines, methods, parallel
from jssl.engines import evaluate
from jssl.engines import test_loss as test_loss_engine
from jssl.evaluation import evaluators, monitor


@pytest.fixture(scope="module")
def shared_dirs(tmp_path_factory):
    return prepare_shared_dirs(tmp_path_factory)


def _train_config(shared_dirs, epochs: int):
    config = moco.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.num_epochs = epochs
    config.checkpoint.async_save = False
    return config


@pytest.fixture(scope="module")
def trained(shared_dirs, tmp_path_factory):
    """A MoCo "test" run of 2 epochs whose config evaluates kNN after every epoch and
    k-means after the last: the train engine's own evaluators."""
    enable_compilation_cache(shared_dirs[1])
    config = _train_config(shared_dirs, 2)
    config.evals.knn = evaluate_config.entry("knn", "test", every_epochs=1)
    config.evals.cluster = evaluate_config.entry("cluster", "test")
    config.evals.test_loss = evaluate_config.entry("test_loss", "test")
    config.evals.test_loss.test_loss.split = "test[:100]"
    workdir = str(tmp_path_factory.mktemp("moco_evals"))
    _FINAL_STATE[workdir] = engines.run(config, workdir)["state"]
    return workdir


_FINAL_STATE = {}  # the trained state the train engine returned, by workdir


def _evaluate_config(shared_dirs, checkpoint):
    config = evaluate_config.get_config("test")
    config.data.data_dir = shared_dirs[0]
    config.init.checkpoint = checkpoint
    return config


@pytest.mark.e2e
def test_evaluate_equals_the_standalone_engines_and_records_the_protocol(
    shared_dirs, trained, tmp_path, capsys
):
    config = _evaluate_config(shared_dirs, trained)
    out = engines.run(config, str(tmp_path / "eval"))
    table = capsys.readouterr().out  # the log's summary: a line per headline figure
    assert "8       knn         k20/top1" in table and "jssl_demo test[:100]" in table
    with open(tmp_path / "eval" / "results.json") as f:
        assert json.load(f) == json.loads(json.dumps(out))
    (row,) = out["timeline"]
    assert row["checkpoint_step"] == 8  # 2 epochs of 4 steps: the newest checkpoint
    step_dir = os.path.join(trained, "checkpoints", "8")
    assert row["checkpoint"] == step_dir
    assert set(row["evals"]) == {"knn", "svm", "cluster"}
    for name, record in row["evals"].items():
        protocol = record["protocol"]
        assert protocol["checkpoint_step"] == 8 and protocol["type"] == name
        assert protocol["mode"].startswith("offline")
        assert protocol["dataset"]["name"] == "jssl_demo"

    # kNN straight from the checkpoint, as configs/knn.py:test runs it.
    knn_cfg = knn_config.get_config("test")
    knn_cfg.data.data_dir = shared_dirs[0]
    knn_cfg.init.checkpoint = step_dir
    alone = engines.run(knn_cfg, str(tmp_path / "knn"))
    for k in knn_cfg.knn.ks:
        assert row["evals"]["knn"]["results"][f"k{k}"] == alone[f"k{k}"]

    # SVM and k-means on features extracted by hand.
    ext = extract_config.get_config("test")
    ext.data.data_dir = shared_dirs[0]
    ext.init.checkpoint = step_dir
    ext.extract.layers = ("avgpool",)
    ext.extract.splits = ("test[:100]", "train[:256]")
    engines.run(ext, str(tmp_path / "features"))
    svm_cfg = svm_config.get_config("test")
    svm_cfg.data.data_dir = shared_dirs[0]
    svm_cfg.svm.features_dir = str(tmp_path / "features")
    svm_cfg.svm.train_split, svm_cfg.svm.test_split = "train[:256]", "test[:100]"
    svm_alone = engines.run(svm_cfg, str(tmp_path / "svm"))
    got = row["evals"]["svm"]["results"]["layers"]["avgpool"]
    assert got["mAP"] == svm_alone["layers"]["avgpool"]["mAP"]
    assert got["top1"] == svm_alone["layers"]["avgpool"]["top1"]
    cl_cfg = cluster_config.get_config("test")
    cl_cfg.data.data_dir = shared_dirs[0]
    cl_cfg.cluster.features_dir = str(tmp_path / "features")
    cl_cfg.cluster.train_split, cl_cfg.cluster.test_split = "train[:256]", "test[:100]"
    cl_alone = engines.run(cl_cfg, str(tmp_path / "cluster"))
    assert evaluators.figures(row["evals"]["cluster"]["results"]) == evaluators.figures(
        json.loads(json.dumps(cl_alone))
    )
    # The features were removed after use (evaluate.keep_features=False).
    assert not [d for d in os.listdir(tmp_path / "eval" / "evals" / "step_8") if "features" in d]


def test_training_runs_its_evaluators_on_its_checkpoints(trained):
    with open(os.path.join(trained, "evals", "results.json")) as f:
        timeline = json.load(f)["timeline"]
    assert [row["checkpoint_step"] for row in timeline] == [4, 8]
    assert set(timeline[0]["evals"]) == {"knn"}  # every_epochs=1
    assert set(timeline[1]["evals"]) == {"knn", "cluster", "test_loss"}  # the last epoch: all
    assert timeline[1]["evals"]["knn"]["protocol"]["mode"].startswith("inside training")
    with open(os.path.join(trained, evaluate.FINISHED_FILE)) as f:
        assert json.load(f)["step"] == 8


def test_following_a_finished_run_evaluates_each_checkpoint_once(shared_dirs, trained, tmp_path):
    config = _evaluate_config(shared_dirs, trained)
    del config.evals["svm"], config.evals["cluster"]
    config.evaluate.follow = True
    workdir = str(tmp_path / "follow")
    out = engines.run(config, workdir)
    assert [row["checkpoint_step"] for row in out["timeline"]] == [4, 8]
    first = out["timeline"][1]["evals"]["knn"]["results"]
    # A rerun finds both evaluated and runs nothing again.
    again = engines.run(config, workdir)
    assert [row["checkpoint_step"] for row in again["timeline"]] == [4, 8]
    assert again["timeline"][1]["evals"]["knn"]["results"] == first


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.evals.knn.update(type="nope"), "evals.knn.type='nope'"),
        (lambda c: c.evals.knn.knn.update(temperature=0.0), "knn.temperature"),
        (lambda c: c.evals.svm.svm.update(costs=()), "svm.costs"),
        (lambda c: c.evals.knn.update(every_epochs=-1), "evals.knn.every_epochs"),
        (lambda c: c.evals.svm.update(data={"nonsense": 1}), "evals.svm.data.nonsense"),
        (lambda c: _with_test_loss(c).test_loss.update(batch_size=0), "test_loss.batch_size=0"),
    ],
)
def test_bad_entries_are_refused_before_anything_is_written(shared_dirs, tmp_path, edit, message):
    config = _evaluate_config(shared_dirs, str(tmp_path))
    edit(config)
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        engines.run(config, str(tmp_path / "eval"))
    assert not os.path.exists(tmp_path / "eval")


def _with_test_loss(config):
    config.evals.test_loss = evaluate_config.entry("test_loss", "test")
    return config.evals.test_loss


def test_the_test_loss_is_the_method_loss_of_the_saved_state(shared_dirs, trained, tmp_path):
    """The test_loss evaluator, inside training and alone, against the train engine's test
    phase on the state it returned (no checkpoint read): the whole state (queue included)
    comes back from the checkpoint, and the protocol names what was read."""
    with open(os.path.join(trained, "evals", "results.json")) as f:
        record = json.load(f)["timeline"][1]["evals"]["test_loss"]
    protocol = record["protocol"]
    assert protocol["method"] == "moco" and protocol["split"] == "test[:100]"
    assert protocol["checkpoint_step"] == 8 and protocol["mode"].startswith("inside training")
    assert protocol["dataset"]["name"] == "jssl_demo"
    results = record["results"]
    assert results["num_examples"] == 100 and set(results["terms"]) == {"info_nce"}
    assert results["terms"]["info_nce"] == results["loss"]  # MoCo's one term, weight 1

    config = _train_config(shared_dirs, 2)
    config.data.test_split = "test[:100]"
    config.eval_outputs = False
    mesh = parallel.make_mesh()
    method = methods.get(config, 4)
    reference = monitor.test_phase(
        config,
        monitor.make_test_step(config, method, mesh),
        None,
        _FINAL_STATE[trained],
        mesh,
        workdir=str(tmp_path),
        epoch=2,
    )
    np.testing.assert_allclose(record["results"]["loss"], reference["loss"], rtol=1e-6)


@pytest.mark.slow  # CI: the same engine inside training (the test above)
def test_the_standalone_test_loss_reads_the_workdir_at_its_own_batch(
    shared_dirs, trained, tmp_path
):
    with open(os.path.join(trained, "evals", "results.json")) as f:
        record = json.load(f)["timeline"][1]["evals"]["test_loss"]
    alone = test_loss_config.get_config("test")  # the standalone engine on the workdir
    alone.data.data_dir = shared_dirs[0]
    alone.init.checkpoint = trained
    alone.test_loss.split = "test[:100]"
    alone.test_loss.batch_size = 32  # the run's is 16: only the evaluation pass reads this
    assert test_loss_engine.training_config(alone, trained).data.batch_size == 16
    out = engines.run(alone, str(tmp_path / "alone"))
    np.testing.assert_allclose(out["loss"], record["results"]["loss"], rtol=1e-6)
    assert out["protocol"]["checkpoint"] == os.path.join(trained, "checkpoints", "8")


def test_the_test_loss_needs_a_jssl_workdir(tmp_path):
    config = test_loss_config.get_config("test")
    config.init.checkpoint = str(tmp_path / "resnet.pth")
    with pytest.raises(ValueError, match="holds a trunk alone"):
        engines.run(config, str(tmp_path / "eval"))
    assert not os.path.exists(tmp_path / "eval")


def test_entries_carry_every_field_of_their_sections():
    knn_entry = evaluate_config.entry("knn", "dino")
    assert knn_entry.type == "knn" and knn_entry.every_epochs == 0
    assert knn_entry.knn.to_dict() == {
        **knn_config.get_config("dino").knn.to_dict(),
        "features_dir": "",
    }
    svm_entry = evaluate_config.entry("svm", "voc07", with_data=True)
    assert svm_entry.data.name == "voc/2007"
    assert set(svm_entry.extract) == set(extract_config.get_config("").extract)
    with pytest.raises(ValueError, match="Unknown evaluator type"):
        evaluate_config.entry("nope")


def test_a_per_layer_pooling_spec_is_cut_to_the_extracted_layers():
    spec = "res3=avg:4,4,0;res4=avg:4,2,0;res5=avg:2,2,0"
    assert evaluate.pool_of(spec, ["res4", "avgpool"]) == "res4=avg:4,2,0"
    assert evaluate.pool_of(spec, ["avgpool"]) == "none"
    assert evaluate.pool_of("vissl_resnet50", ["res5"]) == "vissl_resnet50"


def test_a_training_evaluator_whose_split_is_missing_is_refused_at_start(shared_dirs, tmp_path):
    config = _train_config(shared_dirs, 1)
    config.evals.knn = evaluate_config.entry("knn", "test")
    config.evals.knn.knn.test_split = "nope"
    with pytest.raises(ValueError, match=r"evals\.knn: knn\.test_split='nope' cannot be read"):
        engines.run(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")
