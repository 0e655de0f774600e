"""What training optimises and how it is scored offline: the distillation losses and their registry
(:mod:`.losses`), and greedy block efficiency τ replayed over the target's answers (:mod:`.tau`: from a draft
model's teacher-forced pass, or from the training unroll of heads, on :func:`specdraft.tau.greedy_steps`). Imports
nothing else of training."""
