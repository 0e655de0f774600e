"""The draft model's stages: ``init-drafter`` (:mod:`.init_drafter`), ``pretrain`` (:mod:`.pretrain`) and
``finetune`` (:mod:`.finetune`, its settings :mod:`.finetune_config`, its objective and evaluation
:mod:`.distillation`, its on-policy pool :mod:`.regenerate`). Imports the runs, objectives and data of training,
never the heads."""
