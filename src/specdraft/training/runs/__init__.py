"""A training run from start to end: its folder (fingerprints, shard checksums, one writer, atomic replacement:
:mod:`.folders`), its checkpoints and exports (:mod:`.checkpoint`), the training loop every stage runs
(:mod:`.trainer`) and a stage's start and end in its folder (:mod:`.stages`). The lowest layer of training: it
imports nothing else of it."""
