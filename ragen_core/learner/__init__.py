"""The learner: one PPO / GRPO / StarPO update over a token batch, the critic, learner checkpoints,
the Ray actors that hold learners, and the supervised warm start.

Import names from the module that defines them; this package re-exports nothing.
"""
