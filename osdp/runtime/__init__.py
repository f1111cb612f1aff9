"""Training a wrapped model: the one training step (``runtime.step``), several jobs side by side
(``runtime.jobs``), and checkpoints that survive re-planning (``runtime.dcp``)."""
