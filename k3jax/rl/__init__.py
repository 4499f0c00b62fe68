"""Agentic RL: a plain-text tool protocol, environments with scripted solvers, rollouts, GRPO and the RL stage."""
