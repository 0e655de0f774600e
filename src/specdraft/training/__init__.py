"""Training drafters aligned to a target (Goel et al. 2024, arXiv 2403.00858), by role, each subpackage importing
only those below it: :mod:`.runs` (run folders, checkpoints, the training loop) and :mod:`.objectives` (the loss
registry, exact greedy τ); :mod:`.data` (distillation data); :mod:`.drafter` (init-drafter, pretrain, finetune) and
:mod:`.heads` (train-heads). On top: :mod:`.commands` (the subcommands) and :mod:`.recipe` (train-drafter)."""
