"""Environments that run a patched vLLM: build, install, patch an installed one, serve.

- :mod:`.wheel_overlay`: a release wheel with the patched Python files laid over it;
- :mod:`.build`: ``hybridpd build``: a venv from a patched checkout;
- :mod:`.install`: ``hybridpd install``: checkout, apply and build in one step;
- :mod:`.installed`: ``apply --installed``: patch and revert an existing environment;
- :mod:`.pdextras`: NIXL and LMCache beside vLLM;
- :mod:`.kernels`: which compiled kernels an environment's torch can load;
- :mod:`.serving`: what a CPU or CUDA serving environment needs;
- :mod:`.doctor`: ``hybridpd doctor``: this machine against those needs.
"""
