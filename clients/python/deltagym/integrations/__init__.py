"""Adapters of deltagym sandboxes to training frameworks.

deltagym.integrations.trl: TRL's GRPOTrainer(environment_factory=...).
deltagym.integrations.skyrl: a SkyRL-Gym text env, registered as "deltagym".

Each module imports only what its framework needs; this package imports none.
"""
