"""Agentic environments: the plain-text tool protocol and its one parser, the calculator, the lookup and arithmetic
environments with their scripted solvers, the episode API and trajectories, registered by name (`registry`).

Below both the training data (solver demonstrations as a data source, `k3jax.data.tasks`) and RL (rollouts and
GRPO, `k3jax.rl`); of k3jax it imports only the byte tokenizer.
"""
from k3jax.envs.registry import ENVS, demonstrate, demonstration, get, new_episode, problem_rng, reset

__all__ = ["ENVS", "demonstrate", "demonstration", "get", "new_episode", "problem_rng", "reset"]
