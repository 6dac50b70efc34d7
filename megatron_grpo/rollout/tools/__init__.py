"""Tools for the built-in multi-turn tool loop (``rollout.hook: tools``).

- calculator.py: arithmetic on numbers, evaluated from the syntax tree (no ``eval``)
- sandbox.py: Python code in a process of its own, under limits (time, memory,
  processes, output, file size), supervised from the trainer's side
- isolation.py: the operating system's box around it (bubblewrap: namespaces, an
  unprivileged user, no network, no files but its own ``/tmp``)
- registry.py: the tools a config names, and running one call (errors become text)
- calls.py: the tool-call format (parsing a call, rendering a result)
- loop.py: the loop itself, a rollout hook
"""
