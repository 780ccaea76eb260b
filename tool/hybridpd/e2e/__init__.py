"""``hybridpd e2e``: real prefill/decode runs of a hybrid model, stock beside patched.

Modules: :mod:`.envs` (the environments), :mod:`.tinymodel` (the local random-weight
model), :mod:`.servers` (processes: start, readiness, reaping), :mod:`.proxy` (the
P/D proxy), :mod:`.metrics` (``/metrics`` parsing), :mod:`.scenarios` (smoke,
prefix-repetition), :mod:`.report` and :mod:`.plot` (outputs), :mod:`.command` (the
click command, :data:`e2e_command`).

``tinymodel.py``, ``proxy.py`` and ``plot.py`` also run as scripts under the e2e
venv's Python; they import nothing from hybridpd.
"""
