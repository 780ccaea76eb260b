"""Carrying the series to another release: ``pin add`` and ``port``.

- :mod:`.pinadd`: a new pin's record from the package index;
- :mod:`.port`: replays a pin's patches onto another, stopping where a person decides;
- :mod:`.moves`: files the release moved between the two pins;
- :mod:`.apinames`: upstream methods a patch calls that the target lacks.
"""
