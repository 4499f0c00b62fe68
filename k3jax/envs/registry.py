"""The environments by name; episodes and the scripted solvers' demonstrations, pure functions of
(name, seed, index, length).

An environment gives `problem(rng, length)`, the `tools(problem)` its episodes may call, `solver_turn(problem,
outputs)` (the scripted solver's next turn, from the tools' results so far), `links(problem)` (the tool calls the
solver makes: the problem's chain length), `min_length` and `max_solver_turns`.
"""
from __future__ import annotations

import zlib

import numpy as np

from k3jax.data import tokenizer as tok
from k3jax.envs.arithmetic import Arithmetic
from k3jax.envs.episode import Episode
from k3jax.envs.lookup import Lookup
from k3jax.envs.trajectory import Trajectory

# "lookup" and "calc" (chains of one or two links / operations) are the demonstrations' default; "lookup_deep" and
# "calc_long" reach four, so an RL stage can pose problems longer than most of its SFT stage's demonstrations.
ENVS = {"lookup": Lookup(), "calc": Arithmetic(),
        "lookup_deep": Lookup(max_hops=4, response_tokens=256), "calc_long": Arithmetic(max_steps=4)}


def get(name: str):
  if name not in ENVS:
    raise ValueError(f"unknown environment {name!r}; expected one of {sorted(ENVS)}")
  return ENVS[name]


def problem_rng(name: str, seed: int, index: int) -> np.random.Generator:
  """The generator behind problem `index` of environment `name` under `seed` (the synthetic tasks' scheme,
  `k3jax.data.tasks.task_rng`, so demonstration `i` of a data source is problem `i` of its environment)."""
  if seed < 0 or index < 0:
    raise ValueError(f"seed and index must be >= 0, got seed={seed}, index={index}")
  return np.random.default_rng([seed, zlib.crc32(name.encode()), index])


def new_episode(name: str, rng: np.random.Generator, length: int, *, max_turns: int) -> Episode:
  """A new episode of environment `name` whose problem fits a context of `length` tokens."""
  env = get(name)
  if max_turns < env.max_solver_turns:
    raise ValueError(f"{name}: max_turns={max_turns} is fewer than the {env.max_solver_turns} turns its solver "
                     f"may need")
  problem = env.problem(rng, length)
  return Episode(problem, env.tools(problem), max_turns=max_turns)


def reset(name: str, seed: int, index: int, length: int, *, max_turns: int) -> Episode:
  """Episode `index` of environment `name` under `seed`."""
  return new_episode(name, problem_rng(name, seed, index), length, max_turns=max_turns)


def demonstrate(name: str, ep: Episode) -> Trajectory:
  """Plays the scripted solver through `ep` (a fresh episode): the whole episode as a trajectory."""
  env = get(name)
  traj = Trajectory()
  traj.add(ep.prompt_tokens, model=False)
  while not ep.done:
    turn = env.solver_turn(ep.problem, ep.outputs)
    traj.add(tok.encode(turn), model=True)
    step = ep.step(turn)
    if step.result is not None:
      traj.add(tok.encode(step.result), model=False)
  return traj


def demonstration(name: str, rng: np.random.Generator, length: int) -> Trajectory:
  """The solver's episode of the problem `rng` draws, at most `length` tokens (checked)."""
  env = get(name)
  ep = new_episode(name, rng, length, max_turns=env.max_solver_turns)
  traj = demonstrate(name, ep)
  if not ep.outcome().correct or len(traj) > length:
    raise AssertionError(f"{name}: the solver's episode is wrong or longer than {length} tokens: "
                         f"{tok.decode(traj.tokens)!r}")
  return traj
