"""One job, many processes: real processes on this machine, launched as each
engine's users launch them (tests/launch.py, a timeout so that a hang
fails), each checked bit for bit across processes and against the same job
without the bad batch, or close to one without the bad rows."""

import json

import keras
import numpy as np
import pytest

from tests.helpers import BACKEND
from tests.launch import launch
from tests.models import tiny_mlp
from tests.workers.jax_data import GLOBAL, QUARANTINED, STEPS, global_data

pytestmark = pytest.mark.slow


def _results(tmp_path, prefix):
    found = [json.loads((tmp_path / f"{prefix}{i}.json").read_text()) for i in (0, 1)]
    weights = [np.load(tmp_path / f"{prefix}{i}.npz") for i in (0, 1)]
    return found, weights


def _same_everywhere(found, weights, except_for=()):
    """Every figure and every weight the same on both processes."""
    for key in found[0]:
        if key not in except_for:
            assert found[0][key] == found[1][key], key
    assert weights[0].files == weights[1].files
    for key in weights[0].files:
        assert weights[0][key].tobytes() == weights[1][key].tobytes(), key


@pytest.fixture(scope="module")
def jax_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("jax_job")
    launch("jax_processes.py", 2, out)
    return out, *_results(out, "jax")


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution across processes")
class TestJaxAcrossProcesses:
    """2 processes x 2 CPU devices, `keras.distribution` over gloo; rank 1's
    half of the global batch holds the faults."""

    def test_every_process_takes_the_same_decisions(self, jax_job):
        _, found, weights = jax_job
        # Only the messages naming this process's own path or index differ.
        _same_everywhere(found, weights, ("split_refused", "different_settings"))

    def test_the_transaction_equals_the_job_without_the_bad_batch(self, jax_job):
        _, found, (w, _) = jax_job
        assert found[0]["transaction_skipped"] == 1
        assert w["transaction"].tobytes() == w["transaction_clean"].tobytes()
        # Plain Keras trains the same weights (its step is another XLA
        # program, whose moving averages may differ in the last bit).
        trained, plain = w["transaction_trained"], w["transaction_plain_trained"]
        assert trained.tobytes() == plain.tobytes()

    def test_the_graded_handling_equals_the_job_without_the_bad_batch(self, jax_job):
        _, found, (w, _) = jax_job
        f = found[0]
        assert f["graded_skipped_steps"] == 2  # the bad batch, once an epoch
        assert f["graded_bounded_update_steps"] > 0
        # A rejected step changes no statistic: bit for bit the clean job.
        assert w["graded"].tobytes() == w["graded_clean"].tobytes()

    def test_the_guides_stateless_loop_skips_the_bad_batch(self, jax_job):
        _, found, (w, _) = jax_job
        assert found[0]["loop_skipped"] == 1
        assert w["loop"].tobytes() == w["loop_clean"].tobytes()

    def test_nan_guard_as_it_comes_rolls_back_alike(self, jax_job):
        out, found, (w, _) = jax_job
        f = found[0]
        assert [i[:2] for i in f["guard_incidents"]] == [
            ["rejected_step", 5],
            ["rejected_step", 25],
        ]
        assert f["guard_rollbacks"] == 2
        assert f["guard_lr"] == pytest.approx(0.0025)
        assert f["guard_cause"] == "bad_data"
        assert np.isfinite(f["guard_loss"]).all() and np.isfinite(w["guard"]).all()
        # One writer per file: process 0.
        assert sorted(p.name for p in (out / "files0" / "snapshots").iterdir()) == [
            "nanguard_snapshot.npz",
            "nanguard_snapshot.weights.h5",
        ]
        assert (out / "files0" / "report.json").is_file()
        assert not [p for p in (out / "files1").rglob("*") if p.is_file()]

    def test_a_loss_spike_is_rolled_back_at_the_same_step(self, jax_job):
        _, found, _ = jax_job
        spike = found[0]["spike_incidents"][0]
        assert spike[:2] == ["loss_spike", 12]
        assert spike[2].startswith(
            "rolled back: restored the snapshot of epoch 0, step 10"
        )

    def test_raise_and_stop_act_at_the_same_step(self, jax_job):
        _, found, _ = jax_job
        f = found[0]
        assert f["raise_raised"] == "NonFiniteError"
        assert f["stop_raised"] is None
        assert f["raise_incidents"] == [
            [
                "rejected_step",
                9,
                "restored the snapshot of epoch 0, step 8, raised NonFiniteError",
            ]
        ]
        assert f["stop_incidents"] == [
            [
                "rejected_step",
                9,
                "restored the snapshot of epoch 0, step 8, stopped training",
            ]
        ]

    def test_the_quarantine_trains_as_the_global_batches_without_them(self, jax_job):
        _, found, (w, _) = jax_job
        assert found[0]["quarantine_incidents"] == ["quarantined_samples"]
        assert found[0]["quarantined"] == [list(r) for r in QUARANTINED]
        # One process alone, on the global batches without the bad rows.
        keras.utils.set_random_seed(0)
        model = tiny_mlp()
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
        )
        x, y = global_data()
        for b in range(STEPS):
            keep = [r for r in range(GLOBAL) if (b, r) not in QUARANTINED]
            model.train_on_batch(
                x[b * GLOBAL + np.array(keep)], y[b * GLOBAL + np.array(keep)]
            )
        alone = np.concatenate([np.asarray(v).ravel() for v in model.weights])
        np.testing.assert_allclose(w["quarantine"], alone, rtol=1e-5, atol=1e-7)

    def test_a_split_kernel_keeps_its_shards_and_puts_them_back(self, jax_job):
        _, found, _ = jax_job
        f = found[0]
        assert f["split_kernel_whole_here"] is False
        assert f["split_kernel_spec"] == "P(None, 'model')"
        assert f["split_incidents"] == [
            [
                "rejected_step",
                10,
                "restored the snapshot of epoch 0, step 5, stopped training",
            ]
        ]
        assert f["split_snapshot_step"] == 5
        assert f["split_restored"] is True
        # A snapshot takes what the process's own shards take, no more.
        assert f["split_snapshot_bytes"] == f["split_own_bytes"]
        assert "no process holds the whole state" in f["split_refused"]

    def test_different_settings_are_refused_on_every_process(self, jax_job):
        _, found, _ = jax_job
        for index, f in enumerate(found):
            assert "guards differ in max_rejections" in f["different_settings"]
            assert (
                f"Received on process {index}: max_rejections={3 + index}"
                in (f["different_settings"])
            )


@pytest.mark.skipif(BACKEND != "torch", reason="torch.distributed")
def test_torch_ddp_loop_rejects_skips_and_quarantines_alike(tmp_path):
    """2 gloo processes, the guide's DistributedDataParallel loop."""
    launch("torch_ddp.py", 2, tmp_path)
    found, weights = _results(tmp_path, "torch")
    _same_everywhere(found, weights)
    f, w = found[0], weights[0]
    # A NaN row (batch 4) and a spike (batch 9) in rank 1's half: both
    # processes skip them and equal the same job without those batches.
    assert (f["skipped_steps"], f["spike_steps"], f["iterations"]) == (2, 1, 10)
    assert w["safe"].tobytes() == w["safe_clean"].tobytes()
    np.testing.assert_allclose(w["safe"], w["safe_alone"], rtol=1e-5, atol=1e-7)
    # The rows of the global batch, numbered in it, counted on every process.
    assert f["quarantined_samples"] == 4
    assert [r[:2] for r in f["quarantined"]] == [[4, 9], [4, 13], [9, 2], [9, 10]]
    assert f["quarantine_skipped"] == 0
    # Training with them equals training without them, by one process.
    np.testing.assert_allclose(
        w["quarantine"], w["quarantine_alone"], rtol=1e-5, atol=1e-7
    )
    # clip="adaptive": the same thresholds, bounds and decisions on both
    # processes (checked above), and the same as one process on the global
    # batches without the bad one.
    assert (f["graded_skipped_steps"], f["graded_bounded_update_steps"]) == (1, 11)
    np.testing.assert_allclose(w["graded"], w["graded_alone"], rtol=1e-5, atol=1e-7)
    assert "NaNGuard runs inside Keras's `fit`" in f["nan_guard_error"]
    assert "Received: 2 processes on the torch backend" in f["nan_guard_error"]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute")
def test_multi_worker_mirrored_loop_rejects_and_quarantines_alike(tmp_path):
    """2 MultiWorkerMirroredStrategy workers, the `strategy.run` loop: a NaN
    in one worker's shard is rejected by both; the quarantine counts the
    rows of the global batch and trains as one worker alone without them."""
    launch("tf_mwms.py", 2, tmp_path, ports=2)
    w0, w1 = (np.load(tmp_path / f"worker{i}.npz") for i in range(2))
    assert w0.files == w1.files
    for key in w0.files:
        assert w0[key].tobytes() == w1[key].tobytes(), key
    assert w0["step1_weights"].tobytes() == w0["step0_weights"].tobytes()  # rejected
    assert w0["step2_weights"].tobytes() != w0["step1_weights"].tobytes()  # goes on
    assert [int(w0[f"step{i}_skipped"]) for i in range(3)] == [0, 1, 1]
    assert [int(w0[f"step{i}_iterations"]) for i in range(3)] == [1, 1, 2]
    assert int(w0["quarantine_samples"]) == 4
    assert int(w0["quarantine_skipped"]) == 0
    assert w0["quarantine_rows"].tolist() == [[2, 9], [2, 13], [3, 2], [3, 10]]
    np.testing.assert_allclose(
        w0["quarantine_weights"], w0["quarantine_alone"], rtol=1e-5, atol=1e-7
    )
