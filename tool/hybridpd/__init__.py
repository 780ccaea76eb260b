"""hybridpd: a curated, tested vLLM patch series for hybrid models under PD disaggregation."""

__version__ = "0.1.0"
