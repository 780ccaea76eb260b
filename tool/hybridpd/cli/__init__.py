"""The ``hybridpd`` command line.

One module per command (``checkout``, ``apply`` with ``status``, ``listing``,
``export`` with ``check``, ``pin``, ``port``, ``install`` with ``build``, ``testing``,
``export_pr``, ``doctor``, ``e2e``, ``bench``), shared options in :mod:`.options`, the
``--json`` contract and the one error handler in :mod:`.jsonout`. Each command parses
its options, calls one library function, and renders the result: human text by
default, JSON with ``--json``. The JSON shapes are contracts that scripts and CI
depend on; change them only compatibly. Nothing outside this package imports click.

The group is :mod:`.main`; the console script is :mod:`.entry` (standard library only,
so a Ctrl-C while the CLI imports ends like any other). To add a command: a module here
with a ``@click.command()`` taking the shared :class:`~.options.State`
(``@click.pass_obj``), registered in :mod:`.main`.
"""
