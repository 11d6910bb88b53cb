"""Code shared by the notebooks and by the tests that assert their claims.

The notebooks import this module first (they run with `notebooks/` as the
working directory): it sets the backend and imports TensorFlow without its
start-up log lines; `tests/end_to_end/test_notebooks.py` imports it too, so every claim a
notebook makes is checked by an ordinary test running the same code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _import_tensorflow_quietly() -> None:
    """TensorFlow's start-up notes (oneDNN, CPU features) go to the process's
    stderr through absl before TF_CPP_MIN_LOG_LEVEL applies; in a notebook
    they would open the first cell's output. Only the C++ stream is silenced,
    and only while importing: a failing import still raises as usual. On
    another backend too, where TensorFlow is installed: Keras imports it
    there as well (`keras.utils.set_random_seed` seeds it)."""
    import importlib.util

    if "tensorflow" in sys.modules:
        return
    if os.environ["KERAS_BACKEND"] != "tensorflow" and not importlib.util.find_spec(
        "tensorflow"
    ):
        return
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


_import_tensorflow_quietly()  # before keras, which imports TensorFlow

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_nanguard as ng  # noqa: E402
from keras_nanguard.demo import mlp  # noqa: E402

# The lengths of the notebooks' runs. A reader's run uses these; the tests
# pass shorter ones in (NANGUARD_TUTORIAL_SETTINGS, JSON, read at import)
# and assert the notebooks' claims on that run.
SETTINGS: dict[str, Any] = {
    "sweep_steps_gpt": 600,  # each run of 05_learning_rate's sweep, per task
    "sweep_steps_digits": 600,
    "sweep_rates_gpt": [1e-2, 1e-1, 1.0],  # the sweep's peak rates, per task
    "sweep_rates_digits": [1e-2, 1e-1, 1.0],
}


def _settings(given: str) -> dict[str, Any]:
    chosen = json.loads(given)
    unknown = sorted(set(chosen) - set(SETTINGS))
    if unknown:
        raise ValueError(
            f"NANGUARD_TUTORIAL_SETTINGS: names must be among {sorted(SETTINGS)}. "
            f"Received: {unknown}"
        )

    def like_default(name: str, value: Any) -> Any:
        if isinstance(SETTINGS[name], list):
            return [float(v) for v in value]
        return int(value)

    return {**SETTINGS, **{k: like_default(k, v) for k, v in chosen.items()}}


SETTINGS = _settings(os.environ.get("NANGUARD_TUTORIAL_SETTINGS", "{}"))

GAMMA = 0.99
SOLVED = 195.0  # running reward that counts as "solved" for CartPole-v1


# ------------------------------------------------------------- the agent
@dataclasses.dataclass
class AgentConfig:
    """What the agent is made of. The defaults are the user's broken agent."""

    learning_rate: float = 1.0
    optimizer: str = "rmsprop"
    entropy_beta: float = 0.01
    stable_log_probs: bool = False  # log(softmax) vs policy_log_prob(logits)
    normalize_returns: bool = False
    safe_optimizer: bool = False  # SafeOptimizer(..., clipnorm=1.0)
    init: str = "glorot_uniform"  # "he_normal" fits the ReLU trunk
    hidden: int = 128
    spike_factor: float | None = None  # SafeOptimizer's gradient-spike skipping
    spike_window: int = 128
    # SafeOptimizer (no clipping) for its flight recorder, every step a probe
    flight_recorder: bool = False


FIXED = AgentConfig(
    learning_rate=0.01,
    stable_log_probs=True,
    normalize_returns=True,
    safe_optimizer=True,
    init="he_normal",
)


def make_agent(config: AgentConfig, seed: int = 0) -> keras.Model:
    """Shared trunk, an actor head and a critic head, as on keras.io.

    The user's actor head is a softmax (probabilities); with
    `stable_log_probs` it outputs logits, and log-probabilities are computed
    from them in log space.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    trunk = keras.layers.Dense(
        config.hidden, "relu", kernel_initializer=config.init, name="trunk"
    )(inputs)
    head = None if config.stable_log_probs else "softmax"
    policy = keras.layers.Dense(2, activation=head, name="actor")(trunk)
    value = keras.layers.Dense(1, name="critic")(trunk)
    return keras.Model(inputs, [policy, value], name="actor_critic")


def agent_loss(config: AgentConfig):
    """The loss of one episode, `(y_true, y_pred) -> scalar`, with
    `y_true = (actions, returns)` and `y_pred = (policy, values)`: what the
    training loop minimises, in the form `diagnose()` takes."""

    def loss(y_true, y_pred):
        actions, returns = y_true
        policy, values = y_pred
        actions = ops.cast(actions, "int32")
        if config.stable_log_probs:
            log_probs, entropy = ng.ops.policy_log_prob(policy, actions)
        else:  # log of the whole softmax, then the taken actions
            log_all = ops.log(policy)
            log_probs = ops.take_along_axis(log_all, actions[:, None], axis=-1)[:, 0]
            entropy = -ops.sum(policy * log_all, axis=-1)
        advantage = (returns - ops.stop_gradient(values))[:, 0]
        actor_loss = -ops.sum(log_probs * advantage)
        critic_loss = ops.sum(keras.losses.Huber(reduction=None)(returns, values))
        return actor_loss + critic_loss - config.entropy_beta * ops.sum(entropy)

    return loss


def make_optimizer(config: AgentConfig) -> keras.optimizers.Optimizer:
    inner = keras.optimizers.get(
        {
            "class_name": config.optimizer,
            "config": {"learning_rate": config.learning_rate},
        }
    )
    if not (config.safe_optimizer or config.flight_recorder) and (
        config.spike_factor is None
    ):
        return inner
    return ng.SafeOptimizer(
        inner,
        clipnorm=1.0 if config.safe_optimizer else None,
        spike_factor=config.spike_factor,
        spike_window=config.spike_window,
        probe_every=1 if config.flight_recorder else 16,
    )


@dataclasses.dataclass
class RunResult:
    """What happened in one training run."""

    rewards: list[float]
    running: list[float]
    nan_episode: int | None = None  # first episode whose loss/weights were NaN
    crash: str | None = None  # the exception that ended the run, if any
    solved_at: int | None = None
    skipped_steps: int = 0
    # per episode: the raw global gradient norm of its update, the smallest
    # action probability the policy gave while playing it, and (with
    # `spike_factor`) whether its update was rejected as a gradient spike
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    min_probs: list[float] = dataclasses.field(default_factory=list)
    spikes: list[bool] = dataclasses.field(default_factory=list)
    model: keras.Model | None = None
    optimizer: keras.optimizers.Optimizer | None = None
    # (weights before the update, x, (actions, returns)) of `capture_episode`
    captured: tuple | None = None

    @property
    def final_running(self) -> float:
        return self.running[-1] if self.running else 0.0


def discounted(rewards: list[float], normalize: bool) -> np.ndarray:
    out, g = [], 0.0
    for r in reversed(rewards):
        g = r + GAMMA * g
        out.append(g)
    out = np.array(out[::-1], "float32")
    if normalize:
        out = (out - out.mean()) / (out.std() + 1e-8)
    return out


def _play_episode(
    env: Any, policy: Any, rng: np.random.Generator, seed: int, max_steps: int
) -> tuple[tuple[list, list, list, float] | None, ValueError | None]:
    """One episode of `policy` in `env`.

    Returns `((states, actions, rewards, min_p), None)`, `min_p` the smallest
    action probability the policy gave, or `(None, err)` when `rng.choice`
    refused the policy's probabilities (NaN).
    """
    state, _ = env.reset(seed=seed)
    states, actions, rewards, min_p = [], [], [], 1.0
    for _ in range(max_steps):
        p = ops.convert_to_numpy(policy(state[None].astype("float32")))[0]
        p = p.astype("float64")
        min_p = min(min_p, float(p.min()))
        try:
            action = int(rng.choice(2, p=p / p.sum()))
        except ValueError as err:  # NaN probabilities
            return None, err
        states.append(state)
        actions.append(action)
        state, reward, terminated, truncated, _ = env.step(action)
        rewards.append(reward)
        if terminated or truncated:
            break
    return (states, actions, rewards, min_p), None


def train_agent(
    config: AgentConfig,
    episodes: int,
    seed: int = 0,
    max_steps: int = 500,
    stop_when_solved: bool = True,
    capture_episode: int | None = None,
) -> RunResult:
    """keras.io's actor-critic on CartPole-v1 with a custom GradientTape loop."""
    import gymnasium as gym
    import tensorflow as tf

    env = gym.make("CartPole-v1")
    model = make_agent(config, seed)
    optimizer = make_optimizer(config)
    rng = np.random.default_rng(seed)
    result = RunResult(rewards=[], running=[], model=model, optimizer=optimizer)
    running = 0.0
    loss_fn = agent_loss(config)

    @tf.function
    def policy(state):
        out = model(state)[0]
        return ops.softmax(out) if config.stable_log_probs else out

    for episode in range(episodes):
        # Play an episode with the current policy (compiled, no gradients) ...
        played, err = _play_episode(env, policy, rng, seed + episode, max_steps)
        if err is not None:
            result.crash = f"episode {episode}: np.random.choice: {err}"
            env.close()
            return result
        states, actions, rewards, min_p = played
        # ... then learn from it: the same forward pass, batched, under a tape.
        returns = discounted(rewards, config.normalize_returns)[:, None]
        x = np.array(states, "float32")
        a = np.array(actions)
        if episode == capture_episode:
            result.captured = ([w.copy() for w in model.get_weights()], x, (a, returns))
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            loss = loss_fn((a, returns), outputs)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        _observe(optimizer, config, loss, x, outputs)
        result.grad_norms.append(float(ng.ops.global_norm(grads)))
        result.min_probs.append(min_p)
        if config.spike_factor is not None:
            spikes = optimizer.counters()["spike_steps"]
            result.spikes.append(spikes > sum(result.spikes))

        episode_reward = float(sum(rewards))
        running = 0.05 * episode_reward + 0.95 * running
        result.rewards.append(episode_reward)
        result.running.append(running)
        finite = math.isfinite(float(loss)) and bool(
            ng.ops.all_finite(model.trainable_variables)
        )
        if result.nan_episode is None and not finite:
            result.nan_episode = episode
        if result.solved_at is None and running > SOLVED:
            result.solved_at = episode
            if stop_when_solved:
                break
    if isinstance(optimizer, ng.SafeOptimizer):
        result.skipped_steps = optimizer.counters()["skipped_steps"]
    env.close()
    return result


def _observe(optimizer: Any, config: AgentConfig, loss: Any, x: Any, outputs: Any):
    """Hands the episode's loss, states and policy to a SafeOptimizer's
    flight recorder (after its `apply`)."""
    if isinstance(optimizer, ng.SafeOptimizer):
        probs = outputs[0] if not config.stable_log_probs else None
        optimizer.observe(loss=loss, inputs=x, outputs=probs)


# A learning rate the agent can learn with, returns left unnormalised: nothing
# turns NaN, but the gradient norm grows with the episode length (a return is
# a sum over the rest of the episode), and the run is unstable: in most runs
# the agent reaches the episode cap and its policy later collapses onto one
# action. When, or whether within a few hundred episodes, is chaotic: another
# seed, or the same seed on another CPU (float32 sums rounded in another
# order), gives another trajectory, so the notebook computes its figures and
# the tests assert only what holds for every run. With `spike_factor`
# SafeOptimizer rejects the norm's isolated jumps, not its climb.
RETURNS_UNNORMALISED = AgentConfig(learning_rate=0.03)
SPIKE_GUARD = dict(spike_factor=10.0, spike_window=32)
EARLY_WARNING_EPISODES = 310


def norm_follows_length(result: RunResult) -> float:
    """Correlation of the log gradient norm with the log episode length over
    the run: how much of the norm's climb the episode length explains."""
    length = np.log(np.asarray(result.rewards, "float64"))
    norm = np.log(np.asarray(result.grad_norms, "float64"))
    return float(np.corrcoef(length, norm)[0, 1])


def collapse_episode(result: RunResult, low: float = 12.0, run: int = 10) -> int | None:
    """The first episode of `run` in a row scoring at most `low` (a policy
    stuck on one action), after the agent once reached the episode cap."""
    rewards = result.rewards
    top = next((i for i, r in enumerate(rewards) if r >= 500), None)
    if top is None:
        return None
    for i in range(top, len(rewards) - run + 1):
        if max(rewards[i : i + run]) <= low:
            return i
    return None


# ------------------------------------------------ the models from the reports
# The actor and the critic (WeightNormDense) live in `report_models.py`, beside
# this file (the tests and bench_diagnose.py import it too); re-exported here
# for the notebooks (`tutorial.actor()`, ...).
from report_models import (  # noqa: E402, F401  (re-exported)
    WeightNormDense,
    actor,
    critic,
    gathered_log_prob_loss,
    policy_gradient_loss,
)


# ------------------------------------------------ notebook 1: digits
def digits_data(seed: int = 0) -> tuple[np.ndarray, ...]:
    """scikit-learn's digits (shipped with it, no download): 8x8 images."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype("float32")
    y = keras.utils.to_categorical(d.target, 10).astype("float32")
    order = np.random.default_rng(seed).permutation(len(x))
    train, test = order[:1440], order[1440:]
    return x[train], y[train], x[test], y[test]


def digits_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return mlp(64, 10)  # 64 -> 64 ReLU -> 64 ReLU -> 10 logits, the demo's MLP


class BatchRecorder(keras.callbacks.Callback):
    """Per batch: the loss Keras logs, the gradient norm and whether the step
    was rejected (with a SafeOptimizer), and whether the weights are finite."""

    def on_train_begin(self, logs=None):
        self.loss, self.grad_norm, self.rejected, self.finite = [], [], [], []
        self._safe = (
            self.model.optimizer
            if isinstance(self.model.optimizer, ng.SafeOptimizer)
            else None
        )
        self._skipped = 0

    def on_train_batch_end(self, batch, logs=None):
        self.loss.append(float((logs or {}).get("loss", np.nan)))
        self.finite.append(bool(ng.ops.all_finite(self.model.trainable_variables)))
        if self._safe is not None:
            c = self._safe.counters()
            self.grad_norm.append(c["last_grad_norm"])
            self.rejected.append(c["skipped_steps"] > self._skipped)
            self._skipped = c["skipped_steps"]


def train_digits(
    guarded: bool,
    epochs: int = 6,
    bad_batches=None,
    spike_step: int = 100,
    seed: int = 0,
) -> dict:
    """The quickstart's run: a NaN batch (every epoch) and a learning-rate spike."""
    x, y, x_test, y_test = digits_data(seed)
    model = digits_model(seed)
    optimizer = keras.optimizers.Adam(1e-3)
    callbacks: list = []
    if guarded:
        optimizer = ng.SafeOptimizer(optimizer, clipnorm=5.0)
        callbacks.append(ng.NaNGuard(verbose=0))
    recorder = BatchRecorder()
    callbacks += [
        recorder,
        ng.faults.LearningRateSpike(at_steps=[spike_step], factor=1e30),
    ]
    data = ng.faults.PoisonedBatches(
        x,
        y,
        batch_size=32,
        bad_batches={12: "nan"} if bad_batches is None else bad_batches,
        target="both",
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.CategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        data, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks
    )
    test_loss, test_acc = model.evaluate(x_test, y_test, verbose=0)
    return {
        "history": history.history,
        "batches": recorder,
        "test_accuracy": float(test_acc),
        "test_loss": float(test_loss),
        "weights_finite": bool(ng.ops.all_finite(model.trainable_variables)),
        "guard": callbacks[0] if guarded else None,
        "first_nonfinite_step": next(
            (i for i, ok in enumerate(recorder.finite) if not ok), None
        ),
    }


# ----------------------------------------- notebook 3: image observations
def bar_images(n: int, seed: int = 0, shape=(36, 64)) -> tuple[np.ndarray, np.ndarray]:
    """Images made in code: a bright bar on the left or the right half; the
    right action is the bar's side."""
    rng = np.random.default_rng(seed)
    h, w = shape
    x = rng.random((n, h, w, 3), dtype=np.float32) * 0.2
    side = rng.integers(0, 2, n)
    for i, s in enumerate(side):
        col = rng.integers(2, w // 2 - 4) + s * (w // 2)
        x[i, :, col : col + 3, :] = 1.0
    return x, side.astype("int32")


def image_actor(stable: bool) -> keras.Model:
    """The user's conv actor (scaled down to 36x64x3); `stable` swaps its
    softmax head for StableSoftmax(log_probs=True) over logits."""
    head = None
    if stable:
        head = keras.Sequential(
            [keras.layers.Dense(2, name="logits"), ng.StableSoftmax(log_probs=True)],
            name="policy",
        )
    return actor(head=head)


def train_image_policy(
    stable: bool,
    safe: bool,
    steps: int = 60,
    epsilon: float = 0.2,
    learning_rate: float = 1e-3,
    reward_scale: float = 100.0,
    seed: int = 0,
) -> dict:
    """REINFORCE on the bar task with a custom GradientTape loop and an
    epsilon-greedy (off-policy) action choice, as in the user's report."""
    import tensorflow as tf

    model = image_actor(stable)
    optimizer = keras.optimizers.RMSprop(learning_rate)
    if safe:
        optimizer = ng.SafeOptimizer(optimizer, clipnorm=1.0)
    rng = np.random.default_rng(seed)
    rewards, nan_step = [], None
    for step in range(steps):
        x, side = bar_images(16, seed=seed * 1000 + step)
        out = ops.convert_to_numpy(model(x))
        probs = np.exp(out) if stable else out
        greedy = probs.argmax(-1)
        explore = rng.random(16) < epsilon
        actions = np.where(explore, rng.integers(0, 2, 16), greedy).astype("int32")
        reward = np.where(actions == side, 1.0, -1.0).astype("float32") * reward_scale
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            logp_all = out if stable else ops.log(out)
            logp = ops.take_along_axis(logp_all, actions[:, None], axis=-1)[:, 0]
            loss = -ops.mean(logp * reward)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        rewards.append(float(np.mean(actions == side)))
        if nan_step is None and not bool(ng.ops.all_finite(model.trainable_variables)):
            nan_step = step
    x, side = bar_images(256, seed=99)
    out = ops.convert_to_numpy(model(x))
    accuracy = (
        float(np.mean(out.argmax(-1) == side)) if nan_step is None else float("nan")
    )
    return {
        "hit_rate": rewards,
        "nan_step": nan_step,
        "accuracy": accuracy,
        "skipped": optimizer.counters()["skipped_steps"] if safe else 0,
    }


def learning_rate_sweep(
    tasks: str = "gpt,digits", arms: str = "clipnorm,zclip,adaptive", seeds: str = "0"
) -> dict:
    """A reduced run of `benchmarks/bench_stable_lr.py` (the repository's
    learning-rate sweep), in this process, with the benchmark's own JAX
    loop: per task its peak rates (`rates`) and its summary per arm
    (`arms`), as the benchmark's `--json` writes it. Each task's runs are
    `SETTINGS["sweep_steps_<task>"]` steps long, at the peak rates
    `SETTINGS["sweep_rates_<task>"]`."""
    if keras.backend.backend() != "jax":
        raise RuntimeError(
            "The learning-rate sweep trains with the benchmark's JAX loop: "
            "set KERAS_BACKEND=jax before importing tutorial (the notebook's "
            f"first cell does). Received: backend {keras.backend.backend()!r}"
        )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    benchmarks = os.path.join(root, "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import bench_stable_lr as bench

    summary = {}
    for task in tasks.split(","):
        rates = SETTINGS[f"sweep_rates_{task}"]
        found = bench.sweep(
            [task],
            arms.split(","),
            rates,
            [int(s) for s in seeds.split(",")],
            SETTINGS[f"sweep_steps_{task}"],
            lambda line: None,
        )
        summary[task] = {"rates": rates, "arms": bench.summarize(found[task], rates)}
    return summary
