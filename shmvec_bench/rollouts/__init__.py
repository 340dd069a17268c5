"""The rollout benchmark: complete groups of trajectories, against the runners agent
trainers use.

- ``workloads``: ``shmvec.text_envs``'s text games (gem-llm games, FrozenLake as
  text) plus each workload's costs (CPU, tool waits, faults, stragglers).
- ``policies``: P2 a GPU decode batch's latency model, P1 a tiny torch GRU.
- ``backends``: one runner per module, each citing the framework file it mirrors;
  ``shmvec`` (the rollout layer) and ``shmvec-loop`` (a bare send/recv loop).
- ``records``: tasks, trajectories, groups, and the plumbing the async runners share.
- ``runner``: one timed run (``measure``) and the median of several.
- ``report``, ``cli``: the table, CSV and plot; ``shmvec-bench rollouts``.
"""
