"""Benchmarks of tensortier against the peers a user would pick instead: one module per area,
peers side by side in the same run, a table printed and JSON written (``--json FILE``).

A plain folder of the repository, not part of the installed library (as torchao and safetensors
keep theirs): run from the repository root as ``python -m benchmarks <area> [args]``; nothing in
``src/tensortier`` imports it. See ``benchmarks/README.md``.
"""
