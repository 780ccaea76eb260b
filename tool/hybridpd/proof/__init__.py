"""Proving the series: test environments, the red->green patch tests and vLLM's own suites.

- :mod:`.testenv`: a pin's test environment (a venv over the release wheel);
- :mod:`.testrun`: ``hybridpd test``: stock / without / patched runs and their table;
- :mod:`.pytestrun`: one pytest run in a test environment;
- :mod:`.upstream`: vLLM's own tests of the touched modules, and their stock baselines;
- :mod:`.hfsnap`: the hub snapshots tests read offline.
"""
