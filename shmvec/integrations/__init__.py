"""Adapters for RL trainers, each an optional extra: ``shmvec.integrations.verl``
(verl's agent loop over awaitable envs). ``chat_tokens`` builds a chat's token ids by
appending, as the adapters do."""
