"""``hybridpd export-pr``: a carried patch as an upstream pull request (its commits,
upstream-style tests, text and measured evidence), verified red on stock and green after
``git am``.

One job per module, each importing only from those above it in this list:

* ``layout``: the layout of an exported PR directory (its files, the upstream-style
  material under ``data/upstream_tests/``, the manifest) and ``ExportPrError``;
* ``candidates``: which carried patches to propose upstream, which to drop where, and
  the newest pin (``hybridpd list --upstream-candidates``);
* ``commits``: the commits of a directory, each patch with its tests, and the earlier
  patches it needs;
* ``author``: who authors the PR commits (the submitter, never the project identity);
* ``conventions``: what differs between the projects a PR goes to (vLLM, LMCache);
* ``evidence``: the measured results a PR cites (committed e2e reports) and their age;
* ``render``: the PR text, ``PR.md`` (or ``COMMENT.md`` for an open PR's thread), and
  the notes to its submitter, ``SUBMITTING.md``;
* ``checks``: the target project's own pre-commit checks, at their pins, offline;
* ``verify``: ``--verify``, the added tests red on stock and green after ``git am``;
* ``export``: the export itself, one directory per patch, and the command's ``run``.
"""
