"""``hybridpd bench``: the decode-side effect of the series at vllm#42524's scale, without
a GPU.

Modules: :mod:`.deployment` (the model's shape, the KV pool and the cost model, derived
from stated figures), :mod:`.env` (a pin's stock and patched trees and test environment),
:mod:`.replay` and :mod:`.lookup` (the two benches), :mod:`.render` (table and PNG);
the command is :mod:`hybridpd.cli.bench`. ``decode_replay.py`` and ``lookup_worker.py`` run as scripts
under the pin's test environment, one per vLLM tree.
"""
