"""Rollouts: SGLang's native HTTP API, a client for it, and an embedded CPU server.

Import the pieces from their modules; the embedded server (transformers,
torch) is kept out of this package's import so that the client stays light.
"""
