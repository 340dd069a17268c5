"""Adapters that put shmvec's env side inside trainers that own the training loop, each an
optional extra: ``shmvec.integrations.trl`` (TRL's ``rollout_func``) and
``shmvec.integrations.verl`` (verl's agent loop over awaitable envs)."""
