"""``hybridpd explain``: whether a hybrid model and a KV connector set start, and how
vLLM lays out their KV cache, on a pin's stock release and with the series, answered
by vLLM's own code in the pin's test environment (no weights, no GPU).

- :mod:`.model`: the user's model config (a directory, or a hub id in their HF cache);
- the connector sets: :mod:`hybridpd.connectors` (the registry), or vLLM's own JSON;
- :mod:`.driver`: the script that runs inside the pin's environment;
- :mod:`.runner`: the trees, the environment, the two drivers side by side;
- :mod:`.render`: the verdict lines.
"""
