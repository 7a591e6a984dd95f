"""loopwise learner: records and the interaction store, turn samples, advantages, losses, the LoRA trainer, publishing.

``python -m learner`` (``loopwise learner``) runs the learner process; it reaches the runtime only over the admin
API and the publish contract (``docs/architecture.md``).
"""
