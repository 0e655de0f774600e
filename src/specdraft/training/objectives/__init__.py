"""What training optimises and how it is scored offline: the distillation losses and their registry
(:mod:`.losses`), and the exact greedy block efficiency τ of a draft model on the target's own answers (:mod:`.tau`).
Imports nothing else of training."""
