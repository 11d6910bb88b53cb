"""NaNGuard's arguments: checked when it is made, with an error that names
the argument; its paths checked again when `fit` begins; plain values in its
config."""

import json

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from keras_nanguard import incidents
from tests.helpers import binary_data, fit_quietly
from tests.models import guard_model as _model


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "retry"}, r"`policy` must be one of .*Received: policy='retry'"),
        (
            {"patience": -1},
            r"`patience` must be an integer >= 0. Received: patience=-1",
        ),
        (
            {"lr_factor": 0.0},
            r"`lr_factor` must be in \(0, 1\]. Received: lr_factor=0.0",
        ),
        ({"lr_factor": 1.5}, r"lr_factor=1.5"),
        ({"skip_batches": -2}, r"skip_batches=-2"),
        ({"snapshot_every": 0}, r"`snapshot_every` must be an integer >= 1 or 'auto'"),
        ({"check_every": "often"}, r"check_every='often'"),
        ({"max_rejections": 0}, r"max_rejections=0"),
        ({"snapshot_budget": 1.0}, r"snapshot_budget=1.0"),
        ({"snapshot_budget": float("nan")}, r"must be in \(0, 1\). .*=nan"),
        ({"verbose": 2}, r"`verbose` must be one of \(0, 1\). Received: verbose=2"),
        ({"directory": ""}, r"`directory` must not be empty. Received: directory=''"),
        ({"replay": (np.ones((4, 2)),)}, r"`replay` must be `\(x, y\)` arrays"),
        (
            {"replay": (np.ones((4, 2)), np.ones((3, 1)))},
            r"the same length. Received: len\(x\)=4, len\(y\)=3",
        ),
    ],
)
def test_bad_arguments_get_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ng.NaNGuard(**kwargs)


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"directory": 123},
            r"`directory` must be a str or an os.PathLike or None. "
            r"Received: directory=123$",
        ),
        ({"report_path": b"r.json"}, r"`report_path` must be a str .*=b'r.json'"),
        ({"verbose": "yes"}, r"`verbose` must be one of \(0, 1\). .*verbose='yes'"),
        ({"verbose": True}, r"Received: verbose=True"),
        ({"policy": None}, r"`policy` must be one of .*Received: policy=None"),
        ({"snapshot_every": 2.5}, r"`snapshot_every` must be an integer >= 1 or"),
        ({"check_every": True}, r"Received: check_every=True"),
        ({"snapshot_budget": "0.1"}, r"`snapshot_budget` must be a number in \(0"),
        ({"lr_factor": np.bool_(True)}, r"`lr_factor` must be a number in \(0, 1\]"),
        ({"skip_batches": 1.0}, r"`skip_batches` must be an integer >= 0"),
        ({"patience": None}, r"Received: patience=None"),
        ({"max_rejections": "3"}, r"Received: max_rejections='3'"),
        ({"loss_spike_sigma": True}, r"`loss_spike_sigma` must be a positive number"),
        ({"loss_spike_window": 10.0}, r"Received: loss_spike_window=10.0"),
        ({"batch_size": np.float32(16)}, r"`batch_size` must be an integer >= 1"),
        ({"replay": 5}, r"`replay` must be .*Received: replay=5"),
    ],
)
def test_arguments_of_the_wrong_type_get_type_errors(kwargs, match):
    with pytest.raises(TypeError, match=match):
        ng.NaNGuard(**kwargs)


@pytest.mark.backend_free
def test_numpy_scalars_and_paths_are_accepted_as_plain_values(tmp_path):
    guard = ng.NaNGuard(
        np.str_("stop"),
        snapshot_every=np.int64(5),
        snapshot_budget=np.float32(0.25),
        check_every=np.int32(2),
        lr_factor=np.float64(0.5),
        skip_batches=np.int8(1),
        patience=np.uint8(2),
        max_rejections=np.int16(4),
        loss_spike_sigma=np.float32(6),
        loss_spike_window=np.int64(10),
        loss_spike_patience=np.int64(2),
        directory=tmp_path / "snaps",
        report_path=tmp_path / "r.json",
        batch_size=np.int64(8),
        quarantine=np.bool_(True),
        max_quarantine_fraction=np.float32(0.25),
        early_warning=np.bool_(False),
        verbose=np.int64(0),
    )
    config = guard.get_config()
    assert config == {
        "policy": "stop",
        "snapshot_every": 5,
        "snapshot_budget": 0.25,
        "check_every": 2,
        "lr_factor": 0.5,
        "skip_batches": 1,
        "patience": 2,
        "max_rejections": 4,
        "loss_spike_sigma": 6.0,
        "loss_spike_window": 10,
        "loss_spike_patience": 2,
        "directory": str(tmp_path / "snaps"),
        "report_path": str(tmp_path / "r.json"),
        "batch_size": 8,
        "quarantine": True,
        "max_quarantine_fraction": 0.25,
        "early_warning": False,
        "verbose": 0,
    }
    # Plain Python values: the config is JSON, as `.keras` files store it.
    assert json.loads(json.dumps(config)) == config
    assert {type(v) for v in config.values()} == {str, int, float, bool}


@pytest.mark.backend_free
def test_config_round_trip():
    guard = ng.NaNGuard("stop", snapshot_every=7, lr_factor=0.25, patience=2)
    clone = ng.NaNGuard.from_config(guard.get_config())
    assert clone.get_config() == guard.get_config()
    assert keras.saving.get_registered_object("keras_nanguard>NaNGuard") is ng.NaNGuard


def test_unwritable_directory_fails_at_train_begin(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    guard = ng.NaNGuard(directory=blocker / "snapshots")
    x, y = binary_data(32)
    with pytest.raises(ValueError, match="`directory` must be a writable directory"):
        _model().fit(x, y, verbose=0, callbacks=[guard])


def test_path_arguments_are_checked_up_front_and_leave_no_temporary_file(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    with pytest.raises(ValueError, match=r"`report_path` .*Received: report_path="):
        ng.NaNGuard(report_path=tmp_path)
    with pytest.raises(ValueError, match=r"`directory` .*Received: directory="):
        ng.NaNGuard(directory=a_file)

    # Paths that change between the constructor and `fit`.
    x, y = binary_data(32)
    report = tmp_path / "report.json"
    guard = ng.NaNGuard(verbose=0, report_path=report)
    report.mkdir()
    with pytest.raises(ValueError, match=r"`report_path` .*Received: report_path="):
        fit_quietly(_model(keras.optimizers.SGD(0.05)), x, [guard], y=y, batch_size=16)
    snap_dir = tmp_path / "snapshots"
    guard = ng.NaNGuard(verbose=0, directory=snap_dir)
    snap_dir.write_text("now a file")
    with pytest.raises(ValueError, match=r"`directory` .*Received: directory="):
        fit_quietly(_model(keras.optimizers.SGD(0.05)), x, [guard], y=y, batch_size=16)

    # The JSON writer cleans up after itself whatever goes wrong.
    with pytest.raises(IsADirectoryError):
        incidents.write_json(str(report), {"incidents": []})
    with pytest.raises(TypeError):
        incidents.write_json(str(tmp_path / "r.json"), {1j: "no JSON key"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a_file",
        "report.json",
        "snapshots",
    ]
    assert list(report.iterdir()) == []
