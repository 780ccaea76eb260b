"""``hybridpd export-pr``: a carried patch as an upstream pull request (its commits,
upstream-style tests, text and measured evidence), verified red on stock and green after
``git am``."""
