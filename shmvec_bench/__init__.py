"""shmvec's benchmark, beside the engine: workloads, a backend registry, the runner, the report.

- ``workloads``: env factories by name (importable, so spawn workers find them).
- ``backends``: one opener per backend, registered by name (``REGISTRY``).
- ``runner``: warm-up, timing, deadlines, case planning, ratios.
- ``policy``, ``rss``: the policy stand-in's wait; a process tree's resident memory.
- ``report``: the markdown table, the CSV, the plot.
- ``handoff``: the GPU hand-off per step (optional torch).
- ``cli``: ``shmvec-bench`` (also ``python -m shmvec_bench`` and ``python -m shmvec.bench``).
"""
