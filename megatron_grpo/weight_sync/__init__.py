"""Weight sync: the learner's weights into the rollout engines after each step.

Every pipeline stage sends its own layers (``mcore.hf_export`` gathers them a layer at a
time under Hugging Face names); the main rank opens and closes the push on the engines.

- push.py: ``WeightPush``, one push from every rank (the trainer's entry point)
- plan.py: what the main rank tells every sender (``SyncPlan``) and what each answers
  (``StageReport``)
- engines.py: the push opened and closed on the engines, through the main rank's runtime
- sender.py: one stage's sender (``StageSender``), its client and broadcast group
- stream.py: size-bounded buckets, each delivered while the next is gathered
- tensor.py, disk.py, distributed.py: the three methods (``rollout.sync.method``)
- sglang_tensor.py: the ``/update_weights_from_tensor`` payload a real SGLang server takes
- server_kinds.py: what each engine is (embedded or SGLang, TP size, host, device)
- check.py: ``rollout.sync.check``, what the engines hold compared with what was sent

The broadcast group itself, which the embedded server joins too, is
``sglang_api.update_group``; the embedded server's side of every method is ``embedded/``.
"""
