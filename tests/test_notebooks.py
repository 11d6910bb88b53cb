"""The notebooks execute, and the claims they make hold, as ordinary assertions
on the same code (`notebooks/tutorial.py`). TensorFlow backend only: the
notebooks' custom loops use `tf.GradientTape`, as the user's code does."""

import dataclasses
import os
import sys

import numpy as np
import pytest

from tests.helpers import BACKEND

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
sys.path.insert(0, NOTEBOOKS)

pytestmark = pytest.mark.skipif(
    BACKEND != "tensorflow", reason="the notebooks run on the TensorFlow backend"
)


@pytest.mark.notebooks
@pytest.mark.parametrize(
    "name",
    sorted(f for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb")),
)
def test_notebook_executes(name):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    assert any("Runtime:" in c.source for c in nb.cells if c.cell_type == "markdown")
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit notebooks with their outputs stripped"
    )
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": NOTEBOOKS}},
    )
    client.execute()  # raises CellExecutionError on any failing cell


def test_quickstart_claims():
    import tutorial

    plain = tutorial.train_digits(guarded=False)
    assert not plain["weights_finite"]
    assert plain["first_nonfinite_step"] == 12  # the poisoned batch
    guarded = tutorial.train_digits(guarded=True)
    assert guarded["weights_finite"] and guarded["test_accuracy"] > 0.9
    guard = guarded["guard"]
    assert guard.rollbacks == 1
    assert np.isfinite(guarded["history"]["loss"]).all()
    assert sum(guarded["batches"].rejected) >= 6


def test_actor_critic_claims():
    import tutorial

    import keras_nanguard as ng

    broken = tutorial.train_agent(tutorial.AgentConfig(), episodes=10)
    assert broken.nan_episode == 1  # NaN after the second episode's update
    assert "Probabilities contain NaN" in broken.crash

    run = tutorial.train_agent(tutorial.AgentConfig(), episodes=2, capture_episode=1)
    weights, x, y = run.captured
    agent = tutorial.make_agent(tutorial.AgentConfig())
    agent.set_weights(weights)
    report = ng.diagnose(agent, x, y, loss=tutorial.agent_loss(tutorial.AgentConfig()))
    assert (report.stage, report.layer, report.causes[0]) == (
        "loss",
        "actor",
        "log_of_zero",
    )

    stable = dataclasses.replace(tutorial.AgentConfig(), stable_log_probs=True)
    r = tutorial.train_agent(stable, episodes=30)
    assert r.nan_episode is None and r.crash is None

    fixed = tutorial.train_agent(tutorial.FIXED, episodes=300)
    assert fixed.nan_episode is None
    assert fixed.solved_at is not None and fixed.final_running > tutorial.SOLVED


def test_image_observation_claims():
    import tutorial

    plain = tutorial.train_image_policy(stable=False, safe=False)
    assert plain["nan_step"] is not None
    guarded = tutorial.train_image_policy(stable=False, safe=True)
    assert guarded["nan_step"] is None and guarded["skipped"] > 0
    assert guarded["accuracy"] >= 0.9
    fixed = tutorial.train_image_policy(stable=True, safe=True)
    assert fixed["nan_step"] is None and fixed["skipped"] == 0
    assert fixed["accuracy"] >= 0.9


def test_critic_claims():
    import keras
    import tutorial

    import keras_nanguard as ng

    rng = np.random.default_rng(0)
    states = rng.standard_normal((4096, 8)).astype("float32")
    returns = (
        50
        + 40 * np.tanh(states[:, :1] + 0.5 * states[:, 1:2])
        + 5 * rng.standard_normal((4096, 1))
    ).astype("float32")
    smallest = {}
    for act in ["tanh", "relu"]:
        critic = tutorial.critic(act)
        critic.compile(
            optimizer=keras.optimizers.RMSprop(
                1e-3, rho=0.99, epsilon=1e-6, clipnorm=5.0
            ),
            loss="mse",
        )
        critic.fit(states, returns, batch_size=32, epochs=15, verbose=0)
        smallest[act] = min(
            float(np.linalg.norm(critic.get_layer(n).V.numpy(), axis=0).min())
            for n in ["wn1", "wn2", "wn3"]
        )
    # L1 drives the columns of dead ReLU units towards 0; tanh's stay sizable.
    assert smallest["relu"] < 0.05 * smallest["tanh"]

    layer = critic.get_layer("wn2")
    v = layer.V.numpy()
    v[:, 0] = 0.0
    layer.V.assign(v)
    report = ng.diagnose(critic, states[:64], returns[:64])
    assert (report.stage, report.layer, report.causes[0]) == (
        "forward",
        "wn2",
        "invalid_arithmetic",
    )
    assert ng.diagnose(
        tutorial.critic("tanh", g_init=1e3), states[:64], returns[:64]
    ).healthy
    assert not ng.diagnose(
        tutorial.critic("relu", g_init=1e3), states[:64], returns[:64]
    ).healthy
