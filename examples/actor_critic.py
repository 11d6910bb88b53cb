"""Keras's "Actor Critic Method" (CartPole): a shared trunk with a softmax
actor head and a critic head, one episode per update, returns discounted and
normalised, the actor's loss `-log(prob) * advantage` and the critic's Huber
loss; the update in a custom loop, in the form each backend's guide writes
it: `tf.GradientTape` on TensorFlow, `jax.value_and_grad` with
`stateless_call` and `stateless_apply` on JAX (each episode padded to the
longest, so that the step compiles once), `loss.backward()` on PyTorch.
CartPole's physics are written out here (no environment package), and the
episodes are short (at most 60 steps).

Fault `"nan_reward"`: one episode's reward is NaN (a broken environment):
its update is rejected, and `explain()` names `bad_data`.
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import layers, ops

import keras_nanguard as ng
from examples._run import Run

BACKENDS = ("tensorflow", "jax", "torch")
FAULTS = {"nan_reward": "bad_data"}
GAMMA, MAX_STEPS, EPISODES = 0.99, 60, 24
EPS = float(np.finfo(np.float32).eps)


class CartPole:
    """CartPole-v1's dynamics (Barto, Sutton and Anderson), in NumPy."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def reset(self) -> np.ndarray:
        self.state = self.rng.uniform(-0.05, 0.05, 4)
        return self.state.astype("float32")

    def step(self, action: int) -> tuple[np.ndarray, float, bool]:
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
        theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
        x_acc = temp - 0.05 * theta_acc * cos / 1.1
        x, x_dot = x + 0.02 * x_dot, x_dot + 0.02 * x_acc
        theta, theta_dot = theta + 0.02 * theta_dot, theta_dot + 0.02 * theta_acc
        self.state = np.array([x, x_dot, theta, theta_dot])
        done = abs(x) > 2.4 or abs(theta) > 12 * 2 * math.pi / 360
        return self.state.astype("float32"), 1.0, done


def actor_critic_model() -> keras.Model:
    inputs = layers.Input(shape=(4,))
    common = layers.Dense(32, activation="relu")(inputs)
    action = layers.Dense(2, activation="softmax")(common)
    critic = layers.Dense(1)(common)
    return keras.Model(inputs=inputs, outputs=[action, critic])


def returns_of(rewards: list[float]) -> np.ndarray:
    """Discounted returns, normalised (as the example)."""
    returns, discounted = [], 0.0
    for r in reversed(rewards):
        discounted = r + GAMMA * discounted
        returns.insert(0, discounted)
    returns = np.array(returns, "float32")
    return (returns - returns.mean()) / (returns.std() + EPS)


def episode_loss(model_outputs, actions, returns, mask=None):
    """The example's loss over one episode, from the model's outputs on its
    states (with `mask`, 1 per step of the episode and 0 per step of padding:
    the padding's terms left out)."""
    probs, values = model_outputs
    actions, returns = ops.convert_to_tensor(actions), ops.convert_to_tensor(returns)
    values = ops.squeeze(values, -1)
    chosen = ops.take_along_axis(probs, ops.expand_dims(actions, -1), axis=-1)[:, 0]
    advantage = returns - ops.stop_gradient(values)
    if mask is not None:
        # A padded step's probability taken as 1 before the log, so that
        # its term and its gradient are exactly 0 (masking after the log
        # alone: 0 times the gradient of log(0), inf, is NaN).
        mask = ops.convert_to_tensor(mask)
        chosen = ops.where(mask > 0, chosen, 1.0)
    actor_terms = ops.log(chosen) * advantage
    critic_terms = keras.losses.Huber(reduction="none")(
        returns[:, None], values[:, None]
    )
    if mask is not None:
        actor_terms, critic_terms = actor_terms * mask, critic_terms * mask
    return -ops.sum(actor_terms) + ops.sum(critic_terms)


def _episode(env, act) -> tuple[np.ndarray, np.ndarray, list[float]]:
    states, actions, rewards = [], [], []
    state = env.reset()
    for _ in range(MAX_STEPS):
        action = act(state)
        states.append(state)
        actions.append(action)
        state, reward, done = env.step(action)
        rewards.append(reward)
        if done:
            break
    return np.stack(states), np.array(actions, "int32"), rewards


def train(mode: str, fault: str | None = None, seed: int = 0) -> Run:
    if mode == "guard":
        mode = "safe"  # a custom loop: no `fit`, so no NaNGuard
    keras.utils.set_random_seed(seed)
    model = actor_critic_model()
    inner = keras.optimizers.Adam(learning_rate=0.01)
    opt = inner if mode == "plain" else ng.SafeOptimizer(inner)
    opt.build(model.trainable_variables)
    env, rng = CartPole(seed), np.random.default_rng(seed)

    def act(state: np.ndarray) -> int:
        probs = ops.convert_to_numpy(model(state[None])[0])[0].astype("float64")
        return int(rng.choice(2, p=probs / probs.sum()))

    step = _update_function(model, opt)
    lengths = []
    for episode in range(EPISODES):
        states, actions, rewards = _episode(env, act)
        if fault == "nan_reward" and episode == 10:
            rewards[3] = float("nan")
        step(states, actions, returns_of(rewards))
        lengths.append(float(len(rewards)))

    def check() -> float:
        states, actions, rewards = _episode(CartPole(seed + 1), act)
        outputs = model(states)
        return float(
            ops.convert_to_numpy(episode_loss(outputs, actions, returns_of(rewards)))
        )

    return Run(model, lengths, None, [opt], check)


def _update_function(model, opt):
    """One update from an episode, in the backend's custom-loop form."""
    return {"tensorflow": _tf_step, "jax": _jax_step, "torch": _torch_step}[
        keras.backend.backend()
    ](model, opt)


def _tf_step(model, opt):
    import tensorflow as tf

    def step(states, actions, returns):
        with tf.GradientTape() as tape:
            loss = episode_loss(model(states), actions, returns)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return step


def _jax_step(model, opt):
    import jax

    def loss_fn(trainable, non_trainable, states, actions, returns, mask):
        outputs, non_trainable = model.stateless_call(trainable, non_trainable, states)
        return episode_loss(outputs, actions, returns, mask), non_trainable

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    @jax.jit
    def jitted(state, states, actions, returns, mask):
        trainable, non_trainable, optimizer_variables = state
        (_, non_trainable), grads = grad_fn(
            trainable, non_trainable, states, actions, returns, mask
        )
        trainable, optimizer_variables = opt.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return trainable, non_trainable, optimizer_variables

    def step(states, actions, returns):
        # Each episode padded to MAX_STEPS, the padding masked out of the
        # loss: one compiled step, not one per episode length.
        pad = MAX_STEPS - len(states)
        mask = np.concatenate([np.ones(len(states)), np.zeros(pad)]).astype("float32")
        states = np.pad(states, ((0, pad), (0, 0)))
        actions, returns = np.pad(actions, (0, pad)), np.pad(returns, (0, pad))
        held = (model.trainable_variables, model.non_trainable_variables, opt.variables)
        state = tuple([v.value for v in variables] for variables in held)
        new = jitted(state, states, actions, returns, mask)
        for variables, values in zip(held, new):
            for v, value in zip(variables, values):
                v.assign(value)

    return step


def _torch_step(model, opt):
    import torch

    def step(states, actions, returns):
        model.zero_grad()
        loss = episode_loss(model(states), actions, returns)
        loss.backward()
        grads = [v.value.grad for v in model.trainable_variables]
        with torch.no_grad():
            opt.apply(grads, model.trainable_variables)

    return step
