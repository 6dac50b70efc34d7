"""SGLang's native HTTP API as both sides here speak it: the trainer's client (rollout/)
and the embedded CPU engine (embedded/).

- types.py: sampling parameters, a generation, a rollout request (the JSON's typed form)
- protocol.py: those to and from SGLang's ``/generate`` JSON
- errors.py: what talking to an engine can fail with
- update_group.py: the broadcast group a distributed weight update joins, as SGLang
  joins it (``update_weights_from_distributed``), on both ends (the trainer's senders,
  ``weight_sync/``, and the embedded server)
- compat.py: the SGLang internals that join relies on, declared and checked per release
"""
