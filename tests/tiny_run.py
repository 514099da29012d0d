"""The size of the bandit-tiny runs that tests train end to end: a short warm start, 4 groups of 4
episodes per iteration, 16 validation episodes, short answers (a run of a few iterations then takes
about a minute on 2 cores). Tests add their iterations, batch and backend settings."""

TINY_RUN = [
    "sft.steps=20",
    "sft.episodes_per_tag=32",
    "train.n_groups=[4]",
    "train.group_size=4",
    "val.n_groups=[16]",
    "learner.optim.mini_batch_size=4",
    "rollout.max_new_tokens=24",
]
