"""Adapters for env ecosystems Odyssey did not write (the optional extra `envs`): `reasoning-gym/<dataset>`
(reasoning_gym.py) and `skyrl/<env>` (skyrl.py). The registry resolves these namespaced ids."""
