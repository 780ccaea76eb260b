"""The patch series: its model and edits, the release checkouts it applies to, and the
commits it applies and exports.

- :mod:`.model`: ``series.toml`` (pins, patches, records, risks) and its validation;
- :mod:`.edit`: round-trip edits of ``series.toml``;
- :mod:`.checkout`: a pin's release source as a git tree, from its verified sdist;
- :mod:`.apply`: the series applied to a checkout as one commit per patch;
- :mod:`.export`: patch commits written back to ``patches/<pin>/``, and ``check``;
- :mod:`.releasetree`: cached stock and patched trees of a pin.
"""
