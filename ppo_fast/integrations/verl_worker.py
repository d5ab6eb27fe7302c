"""Importing this module patches verl: the module to name in verl's ``external_lib`` hook.

verl imports ``actor_rollout_ref.model.external_lib`` in every process that builds the
model's config (its trainer's process, where the advantages are computed, and each Ray
worker, where the losses and log-probs run), so::

    python -m verl.trainer.main_ppo ... actor_rollout_ref.model.external_lib=ppo_fast.integrations.verl_worker

runs ``ppo_fast.integrations.verl.patch()`` in each of them.  The backend is ppo_fast's own
choice (``$PPO_FAST_BACKEND``, default ``auto``); set it in the workers' environment
(Ray's ``runtime_env``) to choose another.
"""

from __future__ import annotations

from .verl import patch

HANDLE = patch()
