"""Adapters that put shmvec's env side inside trainers that own the training loop; each
needs its trainer's optional extra."""
