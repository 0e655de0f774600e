"""``specdraft train-heads``: self-drafting heads trained on a frozen target (:mod:`.train_heads`), each kind as the
trainer sees it (:mod:`.kinds`: Medusa and EAGLE; :mod:`.eagle3`; :mod:`.glide`). Imports the runs, objectives and
data of training, never the draft model's stages."""
