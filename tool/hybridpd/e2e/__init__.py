"""``hybridpd e2e``: real prefill/decode runs of a hybrid model, stock beside patched.

Modules: :mod:`.envs` (the environments), :mod:`.tinymodel` (the local random-weight
model), :mod:`.qwen35` (vLLM's Qwen3.5 module without torchvision), :mod:`.servers`
(processes: start, readiness, reaping), :mod:`.reap` (what a killed run left),
:mod:`.lmcache` (LMCache's venv and servers), :mod:`.pair` (the
servers' options and the start of P, D and the front), :mod:`.router` (vllm-router,
the front), :mod:`.proxy` (hybridpd's P/D proxy),
:mod:`.client` (requests to a running pair), :mod:`.metrics` (``/metrics`` parsing),
the scenarios :mod:`.smoke`, :mod:`.correctness` and :mod:`.prefix_repetition`,
:mod:`.run` (one invocation: options in, report out), :mod:`.report` and :mod:`.plot`
(outputs). The click command is :mod:`hybridpd.cli.e2e`.

``tinymodel.py``, ``proxy.py`` and ``plot.py`` also run as scripts under the e2e
venv's Python; they import nothing from hybridpd.
"""
